"""Sweep and cluster specs: expansion into trials, path resolution, and every
problem as `file:line: key: message` at the line the user wrote it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from segctl.schemas import SpecError
from segctl.schemas.cluster import load_cluster
from segctl.schemas.spec import load_spec, spec_kind
from segctl.schemas.sweep import job_keys, load_sweep, set_dotted

ROOT = Path(__file__).resolve().parent.parent

# Line numbers below are counted in these texts.
BASE = """\
model: {demo}/model
data:
  train: {demo}/data/train.jsonl
  valid: {demo}/data/valid.jsonl
train:
  iters: 5
  learning_rate: 1.0e-4
lora:
  rank: 8
"""

CLUSTER = """\
head:
  port: 6380
  stores: stores
planner:
  margin: 0.2
nodes:
  - name: studio-1
    host: lab@10.0.0.2
    chip: m2-ultra
    memory_gb: 192
    labels: {room: lab, rack: 2}
  - name: sim
    local: true
    memory_gb: 0.5
"""


def write(folder: Path, name: str, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    p = folder / name
    p.write_text(text)
    return p


def sweep_with_base(tmp_path, demo_dir, sweep: str, base: str = BASE) -> Path:
    write(tmp_path, "job.yaml", base.format(demo=demo_dir))
    return write(tmp_path, "sweep.yaml", sweep)


def problems(load, path) -> list[str]:
    with pytest.raises(SpecError) as e:
        load(path)
    return e.value.problems


# ------------------------------------------------------------------ expansion


GRID_RANDOM = """\
name: lr-rank
base: job.yaml
grid:
  train.learning_rate: [1.0e-4, 2.0e-4]
  lora.rank: [4, 8]
random:
  seed: 7
  samples: 3
  params:
    train.weight_decay: {log_uniform: [1.0e-5, 1.0e-3]}
    lora.dropout: {uniform: [0.0, 0.1]}
    train.seed: {choice: [1, 2, 3]}
"""


def test_grid_times_random_is_deterministic_and_keeps_types(tmp_path, demo_dir):
    path = sweep_with_base(tmp_path, demo_dir, GRID_RANDOM)
    sweep = load_sweep(path)
    assert sweep.path == str(path) and sweep.spec.retries == 3 and sweep.spec.concurrency is None
    assert len(sweep.trials) == 2 * 2 * 3
    assert [t.index for t in sweep.trials] == list(range(12))
    assert [t.name for t in sweep.trials][:2] == ["t000", "t001"]
    first = sweep.trials[0]
    assert first.job.name == "lr-rank-t000" and first.job.output is None
    # grid-major: the first three trials share the first grid point, with the three draws
    assert [(t.params["train.learning_rate"], t.params["lora.rank"]) for t in sweep.trials[:3]] == \
        [(1e-4, 4)] * 3
    draws = [{k: t.params[k] for k in ("train.weight_decay", "lora.dropout", "train.seed")}
             for t in sweep.trials]
    assert draws[:3] == draws[3:6] == draws[9:12]          # each grid point meets every draw
    assert len({d["lora.dropout"] for d in draws[:3]}) == 3
    for t in sweep.trials:
        assert 1e-5 <= t.params["train.weight_decay"] <= 1e-3
        assert 0.0 <= t.params["lora.dropout"] <= 0.1
        assert type(t.params["lora.rank"]) is int and type(t.params["train.seed"]) is int
        assert t.params["train.seed"] in (1, 2, 3)
        assert type(t.params["train.learning_rate"]) is float
        # the job trains with exactly the trial's values
        assert t.job.train.weight_decay == t.params["train.weight_decay"]
        assert t.job.lora.rank == t.params["lora.rank"] and t.job.train.seed == t.params["train.seed"]
        assert t.job.train.iters == 5                         # from the base
    # same file, same trials; another seed, other draws
    assert [t.model_dump() for t in load_sweep(path).trials] == [t.model_dump() for t in sweep.trials]
    other = load_sweep(write(tmp_path, "sweep.yaml", GRID_RANDOM.replace("seed: 7", "seed: 8")))
    assert [t.params for t in other.trials] != [t.params for t in sweep.trials]


def test_grid_only_random_only_and_neither(tmp_path, demo_dir):
    head = "name: s\nbase: job.yaml\n"
    grid = load_sweep(sweep_with_base(tmp_path, demo_dir, head + "grid:\n  lora.rank: [1, 2, 3]\n"))
    assert [t.params for t in grid.trials] == [{"lora.rank": r} for r in (1, 2, 3)]
    rand = load_sweep(write(tmp_path, "sweep.yaml", head + "random:\n  samples: 4\n  params:\n"
                                                           "    lora.rank: {choice: [4, 8]}\n"))
    assert len(rand.trials) == 4 and all(t.params["lora.rank"] in (4, 8) for t in rand.trials)
    (one,) = load_sweep(write(tmp_path, "sweep.yaml", head)).trials
    assert one.params == {} and one.job.name == "s-t000" and one.job.lora.rank == 8


def test_segment_size_auto_in_the_base_and_as_a_varied_value(tmp_path, demo_dir):
    sweep = load_sweep(sweep_with_base(
        tmp_path, demo_dir, "name: s\nbase: job.yaml\ngrid:\n  memory.segment_size: [auto, 0, 2]\n",
        base=BASE + "memory:\n  segment_size: auto\n"))
    assert [t.job.memory.segment_size for t in sweep.trials] == ["auto", 0, 2]
    (t,) = load_sweep(write(tmp_path, "sweep.yaml", "name: s\nbase: job.yaml\n")).trials
    assert t.job.memory.segment_size == "auto"


def test_paths_resolve_against_the_file_that_wrote_them(tmp_path, demo_dir):
    # base job in jobs/, its paths relative to jobs/; the sweep one folder away
    rel = os.path.relpath(demo_dir, tmp_path / "jobs")
    write(tmp_path / "jobs", "job.yaml", BASE.format(demo=rel))
    # a varied data file is relative to the sweep's folder
    shutil.copy(demo_dir / "data" / "valid.jsonl", tmp_path / "small.jsonl")
    sweep = load_sweep(write(tmp_path / "sweeps", "sweep.yaml",
                             "name: s\nbase: ../jobs/job.yaml\ngrid:\n  data.train: [../small.jsonl]\n"))
    (t,) = sweep.trials
    assert t.job.model == str(demo_dir / "model")
    assert t.job.data.valid == str(demo_dir / "data" / "valid.jsonl")
    assert t.job.data.train == str(tmp_path / "small.jsonl")
    assert t.params == {"data.train": "../small.jsonl"}

    # an inline job's paths are relative to the sweep file's folder
    rel = os.path.relpath(demo_dir, tmp_path / "inline")
    inline = write(tmp_path / "inline", "sweep.yaml", f"""\
name: s
job:
  model: {rel}/model
  data: {{train: {rel}/data/train.jsonl}}
  train: {{iters: 3}}
""")
    (t,) = load_sweep(inline).trials
    assert t.job.model == str(demo_dir / "model")
    assert t.job.data.train == str(demo_dir / "data" / "train.jsonl") and t.job.data.valid is None


def test_helpers():
    d = {"lora": {"rank": 8}}
    set_dotted(d, "lora.dropout", 0.1)
    set_dotted(d, "train.iters", 3)
    assert d == {"lora": {"rank": 8, "dropout": 0.1}, "train": {"iters": 3}}
    keys = job_keys()
    assert {"model", "data.train", "train.learning_rate", "memory.segment_size"} <= set(keys)
    assert "lora" not in keys and "train" not in keys


# ------------------------------------------------------------------ sweep problems


def test_unknown_top_key_and_unknown_dotted_key(tmp_path, demo_dir):
    path = sweep_with_base(tmp_path, demo_dir, """\
name: s
base: job.yaml
grid:
  train.learnin_rate: [1.0e-4]
random:
  samples: 2
  params:
    lora.rnak: {choice: [4]}
concurency: 2
""")
    assert problems(load_sweep, path) == [
        f"{path}:4: grid.train.learnin_rate: unknown job key; did you mean 'train.learning_rate'?",
        f"{path}:8: random.params.lora.rnak: unknown job key; did you mean 'lora.rank'?",
        f"{path}:9: concurency: unknown key; did you mean 'concurrency'?",
    ]


def test_bad_varied_value_points_at_the_sweep_line(tmp_path, demo_dir):
    path = sweep_with_base(tmp_path, demo_dir, """\
name: s
base: job.yaml
grid:
  train.learning_rate:
    - 1.0e-4
    - -2.0e-4
  lora.rank: [4, 0]
""")
    assert problems(load_sweep, path) == [
        f"{path}:6: grid.train.learning_rate[1]: Input should be greater than 0",
        f"{path}:7: grid.lora.rank[1]: Input should be greater than or equal to 1",
    ]


def test_a_draw_that_is_bad_for_some_trials_is_caught(tmp_path, demo_dir):
    path = sweep_with_base(tmp_path, demo_dir, """\
name: s
base: job.yaml
random:
  seed: 0
  samples: 20
  params:
    lora.dropout: {uniform: [0.0, 1.1]}
""")
    # Random(0): the first 16 draws are below 1, the 17th is not; reported once
    (p,) = problems(load_sweep, path)
    assert p == f"{path}:7: random.params.lora.dropout: Input should be less than 1 (drew 1.00072 for trial t016)"


def test_bad_base_value_points_at_the_base_file(tmp_path, demo_dir):
    path = sweep_with_base(tmp_path, demo_dir, "name: s\nbase: job.yaml\ngrid:\n  lora.rank: [4, 8]\n",
                           base=BASE.replace("iters: 5", "iters: five") + "  dropuot: 0.1\n")
    job = tmp_path / "job.yaml"
    # reported once, not once per trial
    assert problems(load_sweep, path) == [
        f"{job}:6: train.iters: Input should be a valid integer, unable to parse string as an integer",
        f"{job}:10: lora.dropuot: unknown key; did you mean 'dropout'?",
    ]


def test_cross_field_problem_goes_to_the_value_that_causes_it(tmp_path, demo_dir):
    path = sweep_with_base(tmp_path, demo_dir,
                           "name: s\nbase: job.yaml\ngrid:\n  memory.segment_size: [0, 2]\n",
                           base=BASE + "memory:\n  grad_checkpoint: true\n")
    assert problems(load_sweep, path) == [
        f"{path}:4: grid.memory.segment_size[1]: memory.grad_checkpoint needs memory.segment_size 0"]
    # when every value fails with the base, the base is the one to fix
    path = write(tmp_path, "sweep.yaml", "name: s\nbase: job.yaml\ngrid:\n  memory.segment_size: [1, 2]\n")
    assert problems(load_sweep, path) == [
        f"{tmp_path}/job.yaml:1: (top): memory.grad_checkpoint needs memory.segment_size 0"]


def test_missing_files(tmp_path, demo_dir):
    path = sweep_with_base(tmp_path, demo_dir, "name: s\nbase: job.yaml\ngrid:\n"
                                               "  data.valid: [nope.jsonl]\n",
                           base=BASE.replace("data/train.jsonl", "data/gone.jsonl")
                                    .replace("{demo}/model", "{demo}/data"))
    job = tmp_path / "job.yaml"
    assert problems(load_sweep, path) == [
        f"{path}:4: grid.data.valid[0]: file not found: {tmp_path}/nope.jsonl",
        f"{job}:1: model: no config.json in {demo_dir}/data (expected a Hugging Face model folder)",
        f"{job}:3: data.train: file not found: {demo_dir}/data/gone.jsonl",
    ]
    missing = write(tmp_path, "sweep.yaml", "name: s\nbase: other.yaml\n")
    assert problems(load_sweep, missing) == [f"{missing}:2: base: file not found: {tmp_path}/other.yaml"]


def test_inline_job_problems_point_into_the_sweep_file(tmp_path, demo_dir):
    path = write(tmp_path, "sweep.yaml", f"""\
name: s
job:
  model: {demo_dir}/nothing
  data: {{train: {demo_dir}/data/train.jsonl}}
  train:
    iters: 3
    warmpu: 2
""")
    assert problems(load_sweep, path) == [
        f"{path}:3: job.model: model folder not found: {demo_dir}/nothing",
        f"{path}:7: job.train.warmpu: unknown key; did you mean 'warmup'?",
    ]


def test_bad_distributions(tmp_path, demo_dir):
    path = sweep_with_base(tmp_path, demo_dir, """\
name: s
base: job.yaml
random:
  samples: 2
  params:
    train.learning_rate: {log_uniform: [0.0, 1.0e-3]}
    lora.dropout: {uniform: [0.1, 0.0]}
    lora.rank: {choice: []}
    train.seed: {chioce: [1, 2]}
    train.warmup: 3
""")
    assert problems(load_sweep, path) == [
        f"{path}:6: random.params.train.learning_rate: log_uniform needs 0 < low < high, got [0.0, 0.001]",
        f"{path}:7: random.params.lora.dropout: uniform needs low <= high, got [0.1, 0.0]",
        f"{path}:8: random.params.lora.rank: choice needs at least one value",
        f"{path}:9: random.params.train.seed: unknown distribution 'chioce'; did you mean 'choice'?",
        f"{path}:10: random.params.train.warmup: expected one of {{log_uniform: [low, high]}}, "
        f"{{uniform: [low, high]}}, {{choice: [values]}}",
    ]


def test_base_and_job_together_or_neither(tmp_path, demo_dir):
    path = sweep_with_base(tmp_path, demo_dir, "name: s\nbase: job.yaml\njob:\n  model: m\n")
    assert problems(load_sweep, path) == [f"{path}:3: job: give either base or job, not both"]
    neither = write(tmp_path, "sweep.yaml", "name: s\ngrid:\n  lora.rank: [4]\n")
    assert problems(load_sweep, neither) == [
        f"{neither}:1: base: required key is missing (or give the job inline as job:)"]


def test_several_problems_in_two_files_at_once(tmp_path, demo_dir):
    path = sweep_with_base(tmp_path, demo_dir, """\
name: bad name
base: job.yaml
grid:
  lora.rank: [4, -1]
  train.lerning_rate: [0.1]
retries: -1
""", base=BASE.replace("rank: 8", "rank: 8\n  scale: 0"))
    assert problems(load_sweep, path) == [
        f"{path}:1: name: String should match pattern '^[A-Za-z0-9][A-Za-z0-9_.-]*$'",
        f"{path}:4: grid.lora.rank[1]: Input should be greater than or equal to 1",
        f"{path}:5: grid.train.lerning_rate: unknown job key; did you mean 'train.learning_rate'?",
        f"{path}:6: retries: Input should be greater than or equal to 0",
        f"{tmp_path}/job.yaml:10: lora.scale: Input should be greater than 0",
    ]


def test_fleet_keys_cannot_be_varied(tmp_path, demo_dir):
    path = sweep_with_base(tmp_path, demo_dir, "name: s\nbase: job.yaml\ngrid:\n  output: [a, b]\n")
    assert problems(load_sweep, path) == [
        f"{path}:4: grid.output: set by the fleet (trial adapters land in the stores)"]


def test_yaml_syntax_errors(tmp_path, demo_dir):
    path = sweep_with_base(tmp_path, demo_dir, "name: s\nbase: job.yaml\ngrid: [1, 2\n")
    (p,) = problems(load_sweep, path)
    assert p.startswith(f"{path}:") and "invalid YAML" in p
    path = sweep_with_base(tmp_path, demo_dir, "name: s\nbase: job.yaml\n", base="model: [x\n")
    (p,) = problems(load_sweep, path)
    assert p.startswith(f"{tmp_path}/job.yaml:") and "invalid YAML" in p
    cluster = write(tmp_path, "cluster.yaml", "nodes:\n  - name: a\n   host: b\n")
    (p,) = problems(load_cluster, cluster)
    assert p.startswith(f"{cluster}:3: invalid YAML")


# ------------------------------------------------------------------ cluster


def test_cluster_loads_and_expands_stores(tmp_path, monkeypatch):
    spec = load_cluster(write(tmp_path, "cluster.yaml", CLUSTER))
    assert spec.head.address == "auto" and spec.head.port == 6380
    assert spec.head.stores == str(tmp_path / "stores")
    assert spec.planner.margin == 0.2 and spec.planner.scale == 1.0
    studio, sim = spec.nodes
    assert (studio.name, studio.host, studio.chip, studio.memory_gb) == ("studio-1", "lab@10.0.0.2",
                                                                         "m2-ultra", 192)
    assert studio.labels == {"room": "lab", "rack": "2"}
    assert sim.local and sim.host is None and sim.chip == "unknown" and sim.memory_gb == 0.5
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    spec = load_cluster(write(tmp_path, "cluster.yaml", CLUSTER.replace("stores: stores", "stores: ~/s")))
    assert spec.head.stores == str(tmp_path / "home" / "s")
    assert load_cluster(write(tmp_path, "c.yaml", "nodes:\n  - {name: a, local: true, memory_gb: 1}\n")
                        ).head.stores == str(Path("~/.segctl").expanduser())


def test_cluster_problems_all_at_once(tmp_path):
    path = write(tmp_path, "cluster.yaml", CLUSTER
                 .replace("margin: 0.2", "margin: 1.5")
                 .replace("{room: lab, rack: 2}", "{Room: lab}")
                 .replace("name: sim", "name: studio-1")
                 .replace("    host: lab@10.0.0.2\n", "")
                 .replace("head:", "haed:"))
    assert problems(load_cluster, path) == [
        f"{path}:1: haed: unknown key; did you mean 'head'?",
        f"{path}:5: planner.margin: Input should be less than 1",
        f"{path}:7: nodes.0.host: required key is missing (or set local: true)",
        f"{path}:10: nodes.0.labels.Room: label key 'Room': use lowercase letters, digits, '.', '_', '-' "
        f"(starting with a letter or digit)",
        f"{path}:11: nodes.1.name: 'studio-1' is already the name of nodes.0",
    ]


def test_cluster_needs_a_node_and_valid_fields(tmp_path):
    path = write(tmp_path, "cluster.yaml", "head:\n  port: 6379\n")
    assert problems(load_cluster, path) == [f"{path}:1: nodes: a cluster needs at least one node"]
    path = write(tmp_path, "cluster.yaml", "nodes:\n  - name: a b\n    local: true\n    memory_gb: 0\n"
                                           "    labels: {chip: m2}\n")
    assert problems(load_cluster, path) == [
        f"{path}:2: nodes.0.name: String should match pattern '^[A-Za-z0-9_-]+$'",
        f"{path}:4: nodes.0.memory_gb: Input should be greater than 0",
        f"{path}:5: nodes.0.labels.chip: label key 'chip' is reserved (chip, name, os come from the node)",
    ]


def test_a_clusters_rdma_cables_name_its_nodes_and_devices(tmp_path):
    """nodes.*.rdma (JACCL's cables: peer -> this node's RDMA device) names other
    nodes of the cluster and devices as ibv_devices lists them; each travels to
    the head as a label segctl.rdma.<peer> and is read back as NodeInfo.rdma."""
    from segctl.orchestrator import fleet
    text = ("nodes:\n"
            "  - {name: a, local: true, memory_gb: 1, rdma: {b: rdma_en3}}\n"
            "  - {name: b, local: true, memory_gb: 1, rdma: {a: rdma_en2}}\n")
    spec = load_cluster(write(tmp_path, "c.yaml", text))
    a, b = spec.nodes
    assert a.rdma == {"b": "rdma_en3"} and b.rdma == {"a": "rdma_en2"}
    labels = fleet.cluster_labels(a)
    assert labels == {"segctl.rdma.b": "rdma_en3"}
    assert "--label segctl.rdma.b=rdma_en3" in fleet.ssh_start_command(
        a.model_copy(update={"host": "a.lan"}), "h:1")[-1]
    row = {"Alive": True, "Resources": {"segctl_node:a": 1.0},
           "Labels": {"segctl.memory_gb": "1", **labels, "rack": "2"}}
    [info], _ = fleet.node_table([row])
    assert info.rdma == {"b": "rdma_en3"} and info.labels == {"rack": "2"}
    bad = write(tmp_path, "bad.yaml", text.replace("{b: rdma_en3}", "{a: rdma_en3, c: x1, b: en 3}"))
    assert problems(load_cluster, bad) == [
        f"{bad}:2: nodes.0.rdma.b: 'en 3' is not an RDMA device name (as ibv_devices "
        "lists them: rdma_en3, say)",
        f"{bad}:2: nodes.0.rdma.a: a node has no cable to itself",
        f"{bad}:2: nodes.0.rdma.c: no node of the cluster is named 'c'",
    ]


# ------------------------------------------------------------------ dispatch and examples


def test_spec_kind():
    assert spec_kind({"nodes": []}) == spec_kind({"head": {}}) == "cluster"
    assert all(spec_kind({k: 1, "name": "x"}) == "sweep" for k in ("base", "job", "grid", "random"))
    assert spec_kind({"model": "m", "train": {}}) == "job" and spec_kind([]) == "job"


def test_examples_validate_through_load_spec(tmp_path, demo_dir):
    # examples/job.yaml points at ../demo: lay the examples out next to a demo
    (tmp_path / "demo").symlink_to(demo_dir)
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    kind, sweep = load_spec(tmp_path / "examples" / "sweep.yaml")
    assert kind == "sweep" and len(sweep.trials) == 8
    assert sweep.trials[0].job.model == str((tmp_path / "demo" / "model").resolve())
    kind, job = load_spec(tmp_path / "examples" / "job.yaml")
    assert kind == "job" and job.name == "my-job"
    kind, cluster = load_spec(ROOT / "examples" / "cluster.yaml")
    assert kind == "cluster" and [n.local for n in cluster.nodes] == [False, False, False, True]
    assert cluster.nodes[0].rdma == {"studio-2": "rdma_en3"}
