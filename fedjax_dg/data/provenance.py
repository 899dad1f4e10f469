"""Which raw folder prepared data were built from, and whether it changed since.

Preparing one of the project's own builders records the source folder's
fingerprint beside the prepared array_record files (`record_source`); every
`load` compares it with the folder now (`check_source`), so a run never uses
images or labels of a folder that has since changed (docs/data.md, "Stale
prepared data"). Only file metadata is read, never the files' bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex

from fedjax_dg.data.registry import (CatalogEntry, OwnEntry,
                                     manual_dir_default, prepared_dir)
from fedjax_dg.errors import DataError

SOURCE_RECORD = "fedjax_dg_source.json"  # beside the prepared data
# The digest of the folder's file listing, in a file of its own: fedjax_dg
# before it compared SOURCE_RECORD's dict whole, so a new key there would make
# an older checkout sharing the data directory refuse data prepared here.
LISTING_RECORD = "fedjax_dg_listing.json"


def _listing(path: str) -> tuple[list[tuple[str, int, int]], float]:
  """((path relative to `path`, size, mtime in ns) of every file below it,
  sorted; the newest mtime in s): metadata only, no file is read."""
  out, newest = [], 0.0
  for root, _, names in os.walk(path):
    for n in names:
      full = os.path.join(root, n)
      st = os.stat(full)
      out.append((os.path.relpath(full, path), st.st_size, st.st_mtime_ns))
      newest = max(newest, st.st_mtime)
  return sorted(out), newest


def source_fingerprint(path: str | None) -> dict | None:
  """A cheap identity of a raw-data folder: absolute path, file count, total
  size, newest mtime, and `listing`, a digest of every file's relative path
  (in a DomainBed folder `<domain>/<class>/<image>`: its labels), size and
  mtime. Only the files' metadata is read, never their bytes: `load` checks
  it at every run (docs/data.md, "Stale prepared data"). None when there is
  no such folder (then the data came from, or will come from, a download)."""
  if not path or not os.path.isdir(path):
    return None
  files, newest = _listing(path)
  digest = hashlib.sha1()
  for rel, size, mtime in files:
    digest.update(f"{rel}\0{size}\0{mtime}\n".encode())
  return dict(path=os.path.abspath(path), files=len(files),
              bytes=sum(f[1] for f in files), mtime=round(newest, 3),
              listing=digest.hexdigest())


def recorded_source(entry: OwnEntry, data_dir: str) -> dict | None:
  """The source the prepared data was built from ({} if unknown: prepared by
  an older fedjax_dg, or from a download), None if nothing is prepared. Data
  prepared before the listing was recorded have no `listing`."""
  done = prepared_dir(entry, data_dir)
  path = os.path.join(done, SOURCE_RECORD)
  if not os.path.exists(path):
    return {} if os.path.isdir(done) else None
  with open(path) as f:
    record = json.load(f)
  listing = os.path.join(done, LISTING_RECORD)
  if record and os.path.exists(listing):
    with open(listing) as f:
      record["listing"] = json.load(f)["listing"]
  return record


def record_source(entry: OwnEntry, data_dir: str, manual_dir: str) -> None:
  """Records `manual_dir`'s fingerprint beside the data just prepared from it."""
  done = prepared_dir(entry, data_dir)
  record = source_fingerprint(manual_dir) or {}
  listing = record.pop("listing", None)
  with open(os.path.join(done, SOURCE_RECORD), "w") as f:
    json.dump(record, f)
  if listing:
    with open(os.path.join(done, LISTING_RECORD), "w") as f:
      json.dump({"listing": listing}, f)


def source_change(before: dict, now: dict) -> str | None:
  """What differs between a recorded source (`recorded_source`) and the
  folder now (`source_fingerprint`), or None. A record without `listing`
  (older data) is compared on the rest only."""
  if before["path"] != now["path"]:
    return (f"they were built from {before['path']} ({before['files']} "
            f"files), but the source folder now is {now['path']} "
            f"({now['files']} files)")
  if (before["files"], before["bytes"]) != (now["files"], now["bytes"]):
    return (f"the folder changed since: {before['files']} files of "
            f"{before['bytes']} bytes then, {now['files']} of {now['bytes']} "
            "now")
  if before["mtime"] != now["mtime"]:
    return "the folder changed since: a file in it was modified"
  if "listing" in before and before["listing"] != now["listing"]:
    return (f"the folder changed since: the same {now['files']} files and "
            "bytes, but files were moved, renamed or replaced (e.g. images "
            "moved to another class folder: relabelled)")
  return None


def source_folder(name: str, data_dir: str, manual_dir: str | None,
                  before: dict | None) -> str:
  """The folder a dataset's prepared data are checked against (and prepared
  from): `manual_dir`; else its default (`manual_dir_default`) if that
  exists; else the folder it was prepared from (a folder dataset's, or one
  given as --manual-dir), if still there."""
  if manual_dir:
    return manual_dir
  default = manual_dir_default(name, data_dir)
  if os.path.isdir(default) or not before or not before.get("path"):
    return default
  return before["path"]


def prepare_command(name: str, entry: OwnEntry, folder: str, force=False) -> str:
  """The `fedjax-dg prepare` command line that prepares `name` from `folder`."""
  words = (["fedjax-dg", "prepare", "folder", "--manual-dir", folder, "--name",
            name] if entry.builder == "Folder" else
           ["fedjax-dg", "prepare", name, "--manual-dir", folder])
  return shlex.join(words + (["--force"] if force else []))


def check_source(name: str, entry: OwnEntry | CatalogEntry, data_dir: str,
                 manual_dir: str | None) -> None:
  """Refuses prepared data built from another folder than the one given now
  (or from the same folder before it changed: files added, removed, edited,
  moved or renamed): a run would silently use the old images or labels.
  Nothing to compare when the folder is absent (prepared data outlive their
  source), nothing is recorded, or `entry` is a catalog dataset."""
  if not isinstance(entry, OwnEntry):
    return
  before = recorded_source(entry, data_dir)
  if not before:
    return
  now = source_fingerprint(source_folder(name, data_dir, manual_dir, before))
  change = source_change(before, now) if now is not None else None
  if change:
    raise DataError(
        f"{name}: the prepared data at {prepared_dir(entry, data_dir)} are "
        f"stale: {change}. Run `{prepare_command(name, entry, now['path'])}` "
        "to prepare it again")


def unlisted(before: dict | None, now: dict | None) -> bool:
  """Whether `before` is a record from before the file listing was kept that
  matches the folder `now` on everything it has."""
  return bool(before) and now is not None and "listing" not in before and (
      source_change(before, now) is None)


def stale(before: dict | None, now: dict | None,
           manual_dir: str | None) -> str | None:
  """Why data prepared from `before` (`recorded_source`) must be prepared
  again from the folder now (`source_fingerprint`), or None."""
  if before is None or now is None:
    return None
  if not before:  # from a download or an old fedjax_dg; a folder is named now
    return "the folder they were built from is unknown" if manual_dir else None
  change = source_change(before, now)
  if change:
    return change
  if unlisted(before, now):
    return ("prepared by an older fedjax_dg, which did not record the file "
            "listing, so moved or renamed files went unnoticed")
  return None
