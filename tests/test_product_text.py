"""The product speaks of the product: no text about the circumstances in which
it was made. A number's provenance is its command, commit, date and machine
model; not who else used the machine, which borrowed machine ran it, a CI
run's number, an issue number or "the development CPU". This test greps the
repository's text for such phrases."""

import os
import re

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
SCANNED = ("docs", "README.md", "colab", "fedjax_dg", "tests", "experiments",
           "benchmarks")
TEXT = (".md", ".py", ".ipynb", ".txt", ".toml", ".json", ".log", ".csv",
        ".cfg")
SKIPPED_DIRS = {"_build", "__pycache__", "generated", ".ipynb_checkpoints"}
# Raw outputs of runs: they record the paths the runs used.
DATA_DIRS = (os.path.join("docs", "results"), os.path.join("docs", "bench-logs"))

PATTERNS = {
    "an issue number": r"\bissues? #?\d+\b|-issue-\d+|\bissue\d+_",
    "the development machine": r"\bdevelopment (CPU|machine|VM)\b",
    "a CI run's number": r"\bCI (run|stop|job) #?\d+|\bstop \d+\b|\bCI at \d+\b",
    "who else used the machine":
        r"\bother (sessions?|engineers?|people's|users'?) ?(jobs)?\b"
        r"|\bsessions'|\bother jobs\b|\bshared with (other|two|five|\d)\b"
        r"|\bshared (2-core |23 GiB )?(machine|CPU|VM|cores)\b|\bunder load\b"
        r"|\bquiet machine\b|\botherwise idle\b|\bat load \d",
    "borrowed machines and their time":
        r"\bborrow(ed|ing)?\b|\bleases?\b|\blent\b|\bworkplace\b"
        r"|\bno GPU machine\b|\bsession's (end|GPU|last|time)|\bnext session\b"
        r"|\bsession that ran\b",
    "this machine, unnamed": r"\bthis (2-core |shared )?(CPU|VM)\b|\bthis shared\b"
                             r"|\bthis 2-core\b",
    "a tool of the workplace": r"\bfarm-(bench|studio)\b",
}
# Paths of the machines the project was developed on (raw outputs keep them).
PATHS = r"/work/(main|wt|shared|runs)\b|\.\./shared/(notes|papers)\b"

# Hits the scan lets stand, each (file, pattern name, the text that
# matches); none today. An entry must name text still in its file.
ALLOWED: set = set()


def scanned_files():
  for top in SCANNED:
    path = os.path.join(ROOT, top)
    if os.path.isfile(path):
      yield top
      continue
    for d, dirs, files in os.walk(path):
      dirs[:] = [x for x in dirs if x not in SKIPPED_DIRS]
      if os.path.relpath(d, ROOT).startswith(os.path.join("docs", "tutorials")):
        continue  # copies of colab/, made by the docs build
      for f in files:
        if f.endswith(TEXT):
          yield os.path.relpath(os.path.join(d, f), ROOT)


def hits():
  """Every (file, pattern name, matched text, line number) in the scan."""
  out = []
  for rel in scanned_files():
    if rel == os.path.join("tests", "test_product_text.py"):
      continue  # the patterns themselves
    data = rel.startswith(DATA_DIRS)
    with open(os.path.join(ROOT, rel), errors="replace") as f:
      for number, line in enumerate(f, 1):
        for name, pattern in PATTERNS.items():
          for m in re.finditer(pattern, line, re.I):
            out.append((rel, name, m.group(0), number))
        if not data:
          for m in re.finditer(PATHS, line):
            out.append((rel, "a path of the machines it was made on",
                        m.group(0), number))
  return out


def test_no_text_about_the_circumstances_of_the_work():
  found = [h for h in hits() if h[:3] not in ALLOWED]
  assert not found, "\n".join(f"{f}:{n}: {name}: {text!r}"
                              for f, name, text, n in found)


def test_every_allowed_hit_is_still_there():
  """The list shrinks as the files are cleaned: an entry whose text is gone
  must go too."""
  present = {h[:3] for h in hits()}
  assert ALLOWED <= present, sorted(ALLOWED - present)


def test_the_patterns_find_what_they_are_for(tmp_path):
  for text, name in [
      ("a bit for bit on the development CPU", "the development machine"),
      ("## Round time (issue 2)", "an issue number"),
      ("(docs/benchmarks.md#x-issue-14)", "an issue number"),
      ("when CI stopped at 90 min (stop 37)", "a CI run's number"),
      ("beside other sessions' jobs at load 10-14", "who else used the machine"),
      ("2 cores shared with other jobs", "who else used the machine"),
      ("the 15-minute lease held one algorithm", "borrowed machines and their time"),
      ("on a lent GPU machine", "borrowed machines and their time"),
      ("~7 h on this CPU", "this machine, unnamed"),
  ]:
    assert re.search(PATTERNS[name], text, re.I), (name, text)
  for text in ["on a 2-core Intel Xeon, 2026-11-27, commit 8775666",
               "is this machine ready? (fedjax-dg doctor)",
               "one persistent compilation cache per test session",
               "the issues of the paper's Algorithm 4"]:
    assert not any(re.search(p, text, re.I) for p in PATTERNS.values()), text
