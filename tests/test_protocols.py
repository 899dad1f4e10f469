"""Every paper protocol runs end to end, in small, on CPU.

Each case takes one paper's experiment file as a researcher would run it
(`config.load` + `--set` overrides + `experiment.run`, the path of
`fedjax-dg run`), on data laid out as the real dataset is: a DomainBed
folder `<root>/<domain>/<class>/*.jpg` with the dataset's real domain names,
class count (and names) and JPEGs of its native size, written with PIL and
prepared by `sources.prepare` (`fedjax-dg prepare NAME --manual-dir`); the
`tiny-imagenet-200` folder for Tiny-ImageNet; DomainNet's folders with
Zhou et al.'s `splits_mini` files for miniDomainNet; for CIFAR-10 /
CIFAR-100 / DomainNet (TFDS catalog datasets, downloaded by TFDS on first
use: impossible offline) a prepared TFDS directory of the catalog's own
builder and features (`cifar.Cifar10` / `Cifar100`, `domainnet.Domainnet`'s
six configs, with their splits generated from PNG / JPEG bytes here), which
`tfds.data_source` opens as it opens the downloaded one. Pretrained
weights are files in the real layout at the real architecture with random
values (`weights_files`): MobileNetV3-Large in torchvision's state-dict
layout (1000 ImageNet classes, `model.skip_head=True` as the FedCCRL
command says), ViT-B/16 in torchvision's layout (`vit_b_16`'s names,
1000-class head). Both are `.safetensors`: the same names and shapes as
torchvision's `.pth` pickle, which needs PyTorch to read (not installed in
the test environment).

Each run is ONE round of ONE local epoch with the paper's model, image size
and batch; what else is reduced, per case (`CASES`), is said there: always
the number of images (a few per class and domain, so that each client holds
at most about one batch: its one local step is a full padded batch of the
paper's size) and the held-out domains (one target instead of every domain
in turn: the others rerun the same programs on other images). The test
asserts the dataset's domains and classes, the model's input shape and
classes, finite losses and accuracies for every algorithm, and that the
weights file was read by the run and its tensors landed where they belong (a
value of the file equals the loaded parameter after the layout's
transposition).

Every case is marked `protocols`, outside the default suite and outside
`make test-slow` (CI): `make test-protocols` (or `pytest -m protocols
tests/test_protocols.py`, one process: the ViT-B/16 and MobileNetV3 rounds
need several GiB each). Each case takes minutes per algorithm and 5-13 GiB;
docs/testing.md has their times. The batches of the FedCCRL and FedSDAF
cases are reduced for memory (below).
"""

from __future__ import annotations

import dataclasses
import io
import os

import jax
import numpy as np
import pytest
from PIL import Image

import weights_files
from fedjax_dg.data import sources
from fedjax_dg.data.registry import DOMAINNET_DOMAINS
from fedjax_dg.data.builders import domainbed_folder, mini_domainnet
from fedjax_dg.models import vit_weights
from fedjax_dg.models import weights as mnv3_weights
from fedjax_dg.run import assemble, experiment
from fedjax_dg.run import config as config_lib
from fedjax_dg.run import presets

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PACS_CLASSES = ("dog", "elephant", "giraffe", "guitar", "horse", "house",
                "person")
VLCS_CLASSES = ("bird", "car", "chair", "dog", "person")
OFFICE_HOME_CLASSES = (
    "Alarm_Clock", "Backpack", "Batteries", "Bed", "Bike", "Bottle", "Bucket",
    "Calculator", "Calendar", "Candles", "Chair", "Clipboards", "Computer",
    "Couch", "Curtains", "Desk_Lamp", "Drill", "Eraser", "Exit_Sign", "Fan",
    "File_Cabinet", "Flipflops", "Flowers", "Folder", "Fork", "Glasses",
    "Hammer", "Helmet", "Kettle", "Keyboard", "Knives", "Lamp_Shade", "Laptop",
    "Marker", "Monitor", "Mop", "Mouse", "Mug", "Notebook", "Oven", "Pan",
    "Paper_Clip", "Pen", "Pencil", "Postit_Notes", "Printer", "Push_Pin",
    "Radio", "Refrigerator", "Ruler", "Scissors", "Screwdriver", "Shelf",
    "Sink", "Sneakers", "Soda", "Speaker", "Spoon", "TV", "Table", "Telephone",
    "ToothBrush", "Toys", "Trash_Can", "Webcam")


@dataclasses.dataclass(frozen=True)
class Folder:
  """A DomainBed dataset as distributed: its domains, classes and the size
  of its JPEGs (PACS: all 227x227; VLCS / OfficeHome: various, one typical
  size here)."""
  builder: type
  classes: tuple[str, ...]
  jpeg_hw: tuple[int, int]


FOLDERS = {
    "pacs": Folder(domainbed_folder.Pacs, PACS_CLASSES, (227, 227)),
    "vlcs": Folder(domainbed_folder.Vlcs, VLCS_CLASSES, (240, 320)),
    "office_home": Folder(domainbed_folder.OfficeHome, OFFICE_HOME_CLASSES,
                          (300, 400)),
}
assert len(OFFICE_HOME_CLASSES) == 65


@dataclasses.dataclass(frozen=True)
class Case:
  """One paper protocol: its experiment file, the dataset, the images per
  class and domain written, the weights file's kind ("" none), the --set
  overrides that reduce it (besides rounds, epochs and the data's place)
  and why each is there."""
  experiment: str
  dataset: str
  per_class: int
  weights: str = ""
  sets: tuple[str, ...] = ()
  reduced: str = ""
  batch: int = 0  # 0: the paper's (the config's)


def _hypergenfl_sets(dataset: str) -> tuple[str, ...]:
  """The experiment file's Fashion-MNIST settings turned into the paper's
  for `dataset` (Sec. 4.1: backbone, input size, epochs, evaluation split),
  as `--set`s."""
  values = presets.scenario_values("standard", dataset)
  return tuple(f"{k}={v}" for k, v in values.items()
               if k.split(".")[0] in ("data", "model"))


# ViT-B/16 training at the paper's batch (128; VLCS 64) back-propagates
# through all 12 blocks (the adapters sit inside each): FedSDAF's round
# needs 55.8 GiB of XLA:CPU buffers at 128 for one client, 4.2 GiB at 8
# (docs/benchmarks.md, "What a protocol costs"), more than a 23 GiB test
# machine gives one test: the batch is VIT_BATCH, each client one batch.
VIT_BATCH = 8
# FedCCRL's round at batch 32 (MobileNetV3-Large at 224 px, each image and
# its augmented views through the network) needs 9.5 GiB of XLA:CPU
# buffers for one client in flight (docs/benchmarks.md), 11.8 GiB of the
# process for two (`run --estimate` on 2 devices: killed for memory): the
# batch is FEDCCRL_BATCH.
FEDCCRL_BATCH = 8
FEDCCRL_REDUCED = (f"batch {FEDCCRL_BATCH} (the paper's 32 needs more memory "
                   "than a 23 GiB machine gives one test)")
# DomainNet's label feature has 345 classes (the model's head too); its
# domains hold images of the first few only, so that each of the 5 source
# clients holds one batch of VIT_BATCH.
DOMAINNET_CLASSES_WITH_IMAGES = VIT_BATCH
VIT_REDUCED = (f"one held-out domain; 1 image per class and domain; batch "
               f"{VIT_BATCH} (the paper's 128 does not fit a 23 GiB machine)")


CASES = {
    # hFedF Table 2 on PACS: the Inception CNN at 32 px, batch 64, d = 1
    # (the sweep's first cell), the 7 algorithms of the table.
    "hfedf_table2_pacs": Case(
        "table2.py", "pacs", 3,
        reduced="one held-out domain (art_painting); 3 images per class and "
        "domain (each client 19 training images: one padded batch of 64)"),
    # HyperGenFL Table 2's settings on the paper's other datasets: the
    # Standard scenario (10 clients, 5 active, beta 0.5), its 8 methods.
    "hypergenfl_cifar10": Case(
        "hypergenfl_table2.py", "cifar10", 0, sets=_hypergenfl_sets("cifar10"),
        reduced="500 training / 20 test images (Dirichlet's minimum of 10 "
        "per client needs a few hundred)"),
    "hypergenfl_cifar100": Case(
        "hypergenfl_table2.py", "cifar100", 0,
        sets=_hypergenfl_sets("cifar100"),
        reduced="400 training / 20 test images; ResNet-50 at 32 px"),
    "hypergenfl_tiny_imagenet": Case(
        "hypergenfl_table2.py", "tiny_imagenet", 0,
        sets=_hypergenfl_sets("tiny_imagenet"),
        reduced="four images per class (800) / 20 val images; ResNet-50 at "
        "64 px"),
    # FedCCRL Table 1: MobileNetV3-Large at 224 px from a torchvision file,
    # 2 clients per source domain, batch 32, its 8 methods.
    "fedccrl_table1_pacs": Case(
        "fedccrl_table1.py", "pacs", 4, weights="mobilenet",
        sets=("model.skip_head=True",),
        reduced="one held-out domain; 4 images per class and domain (each "
        "client ~13: one padded batch); " + FEDCCRL_REDUCED,
        batch=FEDCCRL_BATCH),
    "fedccrl_table1_office_home": Case(
        "fedccrl_table1.py", "office_home", 1, weights="mobilenet",
        sets=("model.skip_head=True",),
        reduced="one held-out domain; 1 image per class and domain (each "
        "client ~29: one padded batch); " + FEDCCRL_REDUCED,
        batch=FEDCCRL_BATCH),
    # FedCCRL Table 1's miniDomainNet columns: 128 px, batch 128 in the
    # paper's code.
    "fedccrl_table1_mini_domainnet": Case(
        "fedccrl_table1_mini_domainnet.py", "mini_domainnet", 1,
        weights="mobilenet", sets=("model.skip_head=True",),
        batch=FEDCCRL_BATCH,
        reduced="one held-out domain (clipart); 1 image per class and "
        "domain; " + FEDCCRL_REDUCED.replace("32", "128")),
    # FedSDAF Table 3: DomainNet (the TFDS catalog), batch 1,024.
    "fedsdaf_table3_domainnet": Case(
        "fedsdaf_table3.py", "domainnet", 1, weights="vit", batch=VIT_BATCH,
        reduced=f"one held-out domain (clipart); images of "
        f"{DOMAINNET_CLASSES_WITH_IMAGES} of the 345 classes, 1 per class "
        "and domain (each client one batch: 1 image of each of the 345 "
        "classes made every client 39 ViT-B/16 steps: ~3 h here at the "
        "OfficeHome case's rate), one test "
        "image; " + VIT_REDUCED.split("; ")[-1].replace("128", "1,024")),
    # FedSDAF Tables 2 and 4: ViT-B/16 at 224 px from a torchvision file,
    # one client per source domain.
    **{f"fedsdaf_{table}_{name}": Case(
        f"fedsdaf_{table}.py", name, 1, weights="vit", batch=VIT_BATCH,
        reduced=VIT_REDUCED)
       for table in ("table2", "table4")
       for name in ("pacs", "vlcs", "office_home")},
}

def write_domainbed(root: str, name: str, per_class: int, seed: int = 0
                    ) -> str:
  """`root/<domain>/<class>/<k>.jpg` of DomainBed dataset `name`: its real
  domain and class folder names, `per_class` JPEGs of its native size per
  class and domain (noise around a class colour shifted per domain)."""
  folder = FOLDERS[name]
  rng = np.random.default_rng(seed)
  h, w = folder.jpeg_hw
  for di, domain in enumerate(folder.builder.DOMAINS):
    for ci, cls in enumerate(folder.classes):
      path = os.path.join(root, domain, cls)
      os.makedirs(path)
      base = np.array([37 * ci % 256, 91 * ci % 256, 60 * di], np.float64)
      for k in range(per_class):
        im = np.clip(base + rng.normal(0, 30, (h, w, 3)), 0, 255)
        Image.fromarray(im.astype(np.uint8)).save(
            os.path.join(path, f"{k}.jpg"), quality=85)
  return root


def write_tiny_imagenet(root: str, val: int = 20) -> str:
  """The `tiny-imagenet-200` folder with the real 200 classes (wnid-like
  names), four 64x64 JPEGs each (with two, Dirichlet's minimum of 10 per
  client fails: its best draw left a client 2), and `val` labeled val
  images."""
  from test_data_sources import write_tiny_imagenet as write
  wnids = tuple(f"n{i:08d}" for i in range(200))
  return write(root, wnids=wnids, per_class=4, val=val, gray=False)


def write_cifar(data_dir: str, name: str, train: int, test: int) -> None:
  """A prepared TFDS directory of catalog dataset `name` ("cifar10" /
  "cifar100"): the catalog builder's own features, version and splits,
  examples generated here (random 32x32 PNGs, labels cycling over the
  classes) instead of downloaded."""
  cifar = pytest.importorskip("tensorflow_datasets.image_classification.cifar")
  base = cifar.Cifar10 if name == "cifar10" else cifar.Cifar100
  classes = 10 if name == "cifar10" else 100

  def examples(split, n):
    rng = np.random.default_rng(len(split))
    for i in range(n):
      buf = io.BytesIO()
      Image.fromarray(rng.integers(0, 256, (32, 32, 3), np.uint8)).save(
          buf, format="PNG")
      ex = {"id": f"{split}_{i:05d}", "image": buf.getvalue(),
            "label": i % classes}
      if name == "cifar100":
        ex["coarse_label"] = i % 20
      yield i, ex

  class Generated(base, skip_registration=True):
    def _split_generators(self, dl_manager):
      del dl_manager
      return {"train": examples("train", train), "test": examples("test", test)}

  Generated.name = name
  Generated(data_dir=data_dir, file_format="array_record").download_and_prepare()


def write_mini_domainnet(root: str, per_class: int = 1) -> str:
  """DomainNet's folders of miniDomainNet's 4 domains x 126 classes
  (`per_class` JPEGs each, DomainNet's class-folder names stood in by
  `class_<k>`) and Zhou et al.'s split files listing them (`splits_mini/
  <domain>_{train,test}.txt`, "<domain>/<class>/<file> <label>"): the
  first image of each class in train, the rest in test."""
  rng = np.random.default_rng(0)
  os.makedirs(os.path.join(root, mini_domainnet.SPLIT_DIR))
  for di, domain in enumerate(mini_domainnet.DOMAINS):
    lines = {"train": [], "test": []}
    for label in range(mini_domainnet.NUM_CLASSES):
      cls = f"class_{label:03d}"
      os.makedirs(os.path.join(root, domain, cls))
      for k in range(per_class):
        base = np.array([2 * label % 256, 60 * di, 128], np.float64)
        im = np.clip(base + rng.normal(0, 30, (96, 128, 3)), 0, 255)
        rel = f"{domain}/{cls}/{domain}_{label:03d}_{k}.jpg"
        Image.fromarray(im.astype(np.uint8)).save(os.path.join(root, rel))
        lines["train" if k == 0 else "test"].append(f"{rel} {label}")
    for split, rows in lines.items():
      with open(os.path.join(root, mini_domainnet.SPLIT_DIR,
                             f"{domain}_{split}.txt"), "w") as f:
        f.write("\n".join(rows) + ("\n" if rows else ""))
  return root


def write_domainnet(data_dir: str, per_class: int = 1,
                    classes: int = 345) -> None:
  """Prepared TFDS directories of the catalog's `domainnet/<domain>` (its
  six configs, 345 classes, train and test splits), as `write_cifar`: the
  catalog builder's own features and version (its label feature declares
  all 345 classes, so the dataset has 345 whatever images it holds),
  `per_class` JPEGs in train for each of the first `classes` classes and
  one image in test, generated here instead of downloaded."""
  domainnet = pytest.importorskip(
      "tensorflow_datasets.image_classification.domainnet")

  def examples(split, n_per_class, seed):
    rng = np.random.default_rng(seed)
    for label in range(classes):
      for k in range(n_per_class):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (48, 64, 3), np.uint8)).save(
            buf, format="JPEG")
        yield f"{split}_{label}_{k}", {"image": buf.getvalue(), "label": label}

  class Generated(domainnet.Domainnet, skip_registration=True):
    def _split_generators(self, dl_manager):
      del dl_manager
      seed = len(self.builder_config.name)
      return {"train": examples("train", per_class, seed),
              "test": ((k, ex) for k, ex in examples("test", 1, seed + 1)
                       if ex["label"] == 0)}

  Generated.name = "domainnet"
  for domain in DOMAINNET_DOMAINS:
    Generated(config=domain, data_dir=data_dir,
              file_format="array_record").download_and_prepare()


@pytest.fixture
def optimized():
  """XLA's optimizations on for these heavy programs (the suite runs with
  them off, conftest.py: cheap compiles; here a MobileNetV3 / ViT-B/16 / 
  ResNet-50 step unoptimized is several times slower)."""
  before = jax.config.values["jax_disable_most_optimizations"]
  jax.config.update("jax_disable_most_optimizations", False)
  yield
  jax.config.update("jax_disable_most_optimizations", before)


def _weights_file(kind: str, tmp_path, num_classes: int) -> tuple[str, dict]:
  """(path, state) of a weights file of `kind` in torchvision's layout at the
  real architecture (the ImageNet head: 1000 classes), random values."""
  from safetensors.numpy import save_file
  from fedjax_dg import models
  if kind == "mobilenet":
    state = weights_files.mobilenet_state("torchvision")
  else:
    model = models.get_model("vit_b16", input_shape=(224, 224, 3),
                             num_classes=1000)
    state = weights_files.vit_state(model, "torchvision")
  del num_classes
  path = str(tmp_path / f"{kind}_torchvision.safetensors")
  save_file(state, path)
  return path, state


def _spy(monkeypatch, module, calls: list):
  """Records every `module.load(path, template, ...)` (the run's reads of
  the weights file) with what it returned."""
  real = module.load

  def load(path, template, **kw):
    out = real(path, template, **kw)
    calls.append((path, out))
    return out

  monkeypatch.setattr(module, "load", load)


def _check_mobilenet_loaded(state, params):
  """The file's tensors where torchvision has them: a conv kernel OIHW ->
  HWIO, an SE 1x1 conv as a Dense, the first Linear transposed."""
  stem = state["features.0.0.weight"]
  np.testing.assert_array_equal(np.asarray(params["stem"]["conv"]["kernel"]),
                                stem.transpose(2, 3, 1, 0))
  se = state["features.4.block.2.fc1.weight"]
  np.testing.assert_array_equal(
      np.asarray(params["block4"]["se"]["fc1"]["kernel"]), se[:, :, 0, 0].T)
  np.testing.assert_array_equal(np.asarray(params["fc1"]["kernel"]),
                                state["classifier.0.weight"].T)


def _check_vit_loaded(state, params):
  """The file's tensors where torchvision has them: the patch conv, block
  11's fused q/k/v rows (q: the first 768, head-major), its MLP, the final
  norm."""
  bb = params["backbone"]
  np.testing.assert_array_equal(np.asarray(bb["embedding"]["kernel"]),
                                state["conv_proj.weight"].transpose(2, 3, 1, 0))
  pre = "encoder.layers.encoder_layer_11"
  qkv = state[f"{pre}.self_attention.in_proj_weight"]
  np.testing.assert_array_equal(
      np.asarray(bb["block_11"]["attn"]["query"]["kernel"]),
      qkv[:768].T.reshape(768, 12, 64))
  np.testing.assert_array_equal(np.asarray(bb["block_11"]["fc2"]["kernel"]),
                                state[f"{pre}.mlp.3.weight"].T)
  np.testing.assert_array_equal(np.asarray(bb["encoder_norm"]["scale"]),
                                state["encoder.ln.weight"])


def _prepare(case: Case, tmp_path) -> tuple[str, str, tuple[str, ...]]:
  """(data_dir, manual_dir, the dataset's domains) with the case's data
  written and prepared."""
  data_dir, raw = str(tmp_path / "data"), str(tmp_path / "raw")
  name = case.dataset
  if name in FOLDERS:
    write_domainbed(raw, name, case.per_class)
    sources.prepare(name, data_dir=data_dir, manual_dir=raw)
    return data_dir, raw, FOLDERS[name].builder.DOMAINS
  if name == "mini_domainnet":
    write_mini_domainnet(raw)
    sources.prepare(name, data_dir=data_dir, manual_dir=raw)
    return data_dir, raw, mini_domainnet.DOMAINS
  if name == "domainnet":
    write_domainnet(data_dir, classes=DOMAINNET_CLASSES_WITH_IMAGES)
    return data_dir, "", DOMAINNET_DOMAINS
  if name == "tiny_imagenet":
    write_tiny_imagenet(raw)
    sources.prepare(name, data_dir=data_dir, manual_dir=raw)
    return data_dir, raw, ("train", "val")
  write_cifar(data_dir, name, train=500 if name == "cifar10" else 400, test=20)
  return data_dir, "", ("train", "test")


def run_protocol(case: Case, tmp_path, monkeypatch, extra=()) -> dict:
  """The case's experiment run for one round (the checks are the caller's):
  {results, models, loads, state, cfg}."""
  data_dir, raw, domains = _prepare(case, tmp_path)
  sets = [f"data.data_dir={data_dir}", f"output_dir={tmp_path / 'runs'}",
          "train.rounds=1", "train.epochs=1", "train.eval_every=1",
          "train.progress=False", *case.sets, *extra]
  if raw:
    sets.append(f"data.manual_dir={raw}")
  if case.dataset in FOLDERS:  # the sweep's grid (or the docstring's --set)
    sets += [f"data.name={case.dataset}",
             f"data.targets={FOLDERS[case.dataset].builder.DOMAINS[0]}"]
  elif case.dataset in ("mini_domainnet", "domainnet"):
    sets.append(f"data.targets={domains[0]}")
  state = None
  if case.weights:
    path, state = _weights_file(case.weights, tmp_path, 0)
    sets.append(f"model.weights={path}")
  if case.batch:
    sets.append(f"train.batch_size={case.batch}")
  cfg = config_lib.apply_overrides(
      config_lib.load(os.path.join(REPO, "experiments", case.experiment)), sets)
  made, loads = [], []
  real_make = assemble.make_model
  monkeypatch.setattr(assemble, "make_model",
                      lambda *a, **kw: made.append(real_make(*a, **kw))
                      or made[-1])
  _spy(monkeypatch, vit_weights, loads)
  _spy(monkeypatch, mnv3_weights, loads)
  results = experiment.run(cfg, echo=lambda *a: None)
  return dict(results=results, models=made, loads=loads, state=state, cfg=cfg,
              domains=domains)


@pytest.mark.protocols
@pytest.mark.parametrize("name", list(CASES))
def test_protocol_runs_one_round(name, tmp_path, monkeypatch, optimized):
  case = CASES[name]
  out = run_protocol(case, tmp_path, monkeypatch)
  results, cfg = out["results"], out["cfg"]
  # The data as the real dataset is named and shaped.
  assert tuple(results["domains"]) == out["domains"]
  model = out["models"][0]
  size = cfg.data.image_size
  assert model.input_shape == (size, size, 3)
  want_classes = {"cifar10": 10, "cifar100": 100, "tiny_imagenet": 200,
                  "mini_domainnet": 126, "domainnet": 345}.get(
      case.dataset) or len(FOLDERS[case.dataset].classes)
  assert model.num_classes == want_classes
  assert model.name == cfg.model.name
  # Every algorithm ran its round: finite losses and accuracies.
  assert sorted(r["algorithm"] for r in results["runs"]) == sorted(
      cfg.algorithms)
  for run in results["runs"]:
    assert np.all(np.isfinite(run["round_metrics"]["loss"])), run["algorithm"]
    final = run["final"]
    for key in ("ood_acc", "id_acc"):
      if key in final:
        assert 0.0 <= final[key] <= 1.0, (run["algorithm"], key, final[key])
    assert "ood_acc" in final, run["algorithm"]
    assert all(np.isfinite(h["train_loss"]) for h in run["history"])
  # The weights file was read by the run, its tensors where they belong.
  if case.weights:
    assert out["loads"], "the run never read model.weights"
    for path, params in out["loads"]:
      assert path == cfg.model.weights
      check = (_check_mobilenet_loaded if case.weights == "mobilenet"
               else _check_vit_loaded)
      check(out["state"], params)
    head = ("fc2" if case.weights == "mobilenet" else "head")
    assert out["loads"][0][1][head]["kernel"].shape[-1] == want_classes
