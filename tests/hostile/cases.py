"""The hostile-input corpus: inputs a careless or hostile user could hand segctl,
each of which it must refuse before any work, in one line and exit 2.

A case runs in a folder of its own that holds a good project (the demo model in
model/, its data in data/, job.yaml, sweep.yaml and cluster.yaml below); the case
replaces some of those files (`files`: path -> text or bytes, None deletes) or
sets keys of model/config.json (`config`: key -> value, DELETE removes it), then
runs `cmd` (a file name that is in the folder becomes its path) and expects
`expect` in the one line segctl prints. `process` cases also run through the real
`segctl` process (tests/test_hostile.py).
"""

from __future__ import annotations

import copy
import json
import struct
from pathlib import Path
from typing import NamedTuple

import yaml

DELETE = object()   # a key to remove

JOB = {"name": "j", "model": "model", "output": "out",
       "data": {"train": "data/train.jsonl", "valid": "data/valid.jsonl", "max_seq_length": 256},
       "train": {"iters": 2}}
SWEEP = {"name": "s", "base": "job.yaml", "grid": {"lora.rank": [4, 8]}}
CLUSTER = {"nodes": [{"name": "here", "local": True, "memory_gb": 8}]}
GOOD_ROW = '{"prompt": "after a", "completion": "b c d"}\n'


class Case(NamedTuple):
    id: str
    cmd: tuple
    expect: str
    files: dict = {}
    config: dict = {}
    process: bool = False


def lay_out(case: Case, demo_dir: Path, folder: Path) -> Path:
    """The case's folder: a good project (links to the demo's model and data), then
    the case's changes."""
    (folder / "model").mkdir(parents=True)
    for f in (demo_dir / "model").iterdir():
        if f.name != "config.json":
            (folder / "model" / f.name).symlink_to(f)
    config = json.loads((demo_dir / "model" / "config.json").read_text())
    for key, value in case.config.items():
        if value is DELETE:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / "model" / "config.json").write_text(json.dumps(config))
    (folder / "data").mkdir()
    for name in ("train.jsonl", "valid.jsonl"):
        (folder / "data" / name).symlink_to(demo_dir / "data" / name)
    for name, spec in (("job.yaml", JOB), ("sweep.yaml", SWEEP), ("cluster.yaml", CLUSTER)):
        (folder / name).write_text(edit(spec, {}))
    for name, content in case.files.items():
        path = folder / name
        path.unlink(missing_ok=True)   # never write through a link into the shared demo
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif content is not None:
            path.write_text(content)
    return folder


def edit(base: dict, changes: dict) -> str:
    """YAML text of `base` with dotted keys set ({"train.seed": -1}) or removed (DELETE)."""
    d = copy.deepcopy(base)
    for key, value in changes.items():
        *parents, last = key.split(".")
        node = d
        for p in parents:
            node = node.setdefault(p, {})
        if value is DELETE:
            node.pop(last, None)
        else:
            node[last] = value
    return yaml.safe_dump(d, sort_keys=False)


def job(**changes) -> dict:
    return {"job.yaml": edit(JOB, {k.replace("__", "."): v for k, v in changes.items()})}


def sweep(**changes) -> dict:
    return {"sweep.yaml": edit(SWEEP, {k.replace("__", "."): v for k, v in changes.items()})}


def node(**changes) -> dict:
    """cluster.yaml whose one node has `changes`."""
    return {"cluster.yaml": edit({"nodes": [{**CLUSTER["nodes"][0], **changes}]}, {})}


def rows(*lines: str, name: str = "data/train.jsonl") -> dict:
    return {name: GOOD_ROW + "".join(lines)}


def nested(depth: int, inner: str = "1") -> str:
    return "[" * depth + inner + "]" * depth


def safetensors(header: dict) -> bytes:
    blob = json.dumps(header).encode()
    return struct.pack("<Q", len(blob)) + blob


# "billion laughs": 9 ** 9 "lol"s in about 500 bytes
LAUGHS = "".join([f'a: &a [{", ".join(["lol"] * 9)}]\n'] + [
    f'{b}: &{b} [{", ".join([f"*{a}"] * 9)}]\n' for a, b in zip("abcdefgh", "bcdefghi")])
# lora.keys entries of the longest allowed count, each `chars` long (a real one is ~16)
def lora_keys(chars: int, count: int = 1024) -> list[str]:
    return [f"layer{i:04d}." + "p" * (chars - 10) for i in range(count)]


GRID_100_100 = {"lora.rank": list(range(1, 101)), "train.seed": list(range(100))}
GRID_32_6 = {k: list(range(1, 33)) for k in (
    "lora.rank", "train.iters", "train.warmup", "train.eval_every", "train.checkpoint_every",
    "memory.head_chunk")}

V, P, S, T = "validate", "plan", "submit", "train"

CASES = [
    # ---- names: they end up in file names, Ray labels and ssh arguments
    Case("sweep-name-250", (V, "sweep.yaml"), "sweep.yaml:1: name: String should have at most 58",
         sweep(name="x" * 250)),
    Case("sweep-name-250-submit", (S, "sweep.yaml"), "name: String should have at most 58",
         sweep(name="x" * 250)),
    Case("sweep-name-traversal", (V, "sweep.yaml"), "name: String should match pattern",
         sweep(name="../../etc/passwd")),
    Case("sweep-name-dot", (P, "sweep.yaml"), "name: String should match pattern", sweep(name=".hidden")),
    Case("sweep-name-dash", (V, "sweep.yaml"), "name: String should match pattern", sweep(name="-rf")),
    Case("sweep-name-newline", (V, "sweep.yaml"), "name: String should match pattern",
         sweep(name="a\nb")),
    Case("sweep-name-nul", (V, "sweep.yaml"), "name: String should match pattern", sweep(name="a\0b")),
    Case("sweep-name-unicode", (V, "sweep.yaml"), "name: String should match pattern",
         sweep(name="ünï\u202ecode")),
    Case("job-name-long", (V, "job.yaml"), "job.yaml:1: name: String should have at most 64",
         job(name="j" * 65)),
    Case("job-name-slash-train", (T, "job.yaml"), "job.yaml:1: name: String should match pattern",
         job(name="a/b")),
    Case("job-name-slash-submit", (S, "job.yaml"), "name: String should match pattern",
         job(name="../x")),
    Case("job-name-empty", (V, "job.yaml"), "name: String should match pattern", job(name="")),
    Case("job-name-escape", (V, "job.yaml"), "name: String should match pattern",
         job(name="\x1b[31mred")),

    # ---- paths in specs
    Case("model-path-nul", (V, "job.yaml"), "model: path '/a\\x00b' has control",
         job(model="/a\0b")),
    Case("model-path-5000", (V, "job.yaml"), "model: path is 5000 characters",
         job(model="m/" * 2500)),
    Case("data-path-long-name", (P, "job.yaml"), "data.train: a name in path",
         job(data__train="x" * 300 + ".jsonl")),
    Case("base-path-long-name", (V, "sweep.yaml"), "base: a name in path",
         sweep(base="b" * 300 + ".yaml")),
    Case("output-path-newline", (T, "job.yaml"), "output: path 'out\\nx'",
         job(output="out\nx")),
    Case("spec-is-a-device", (V, "/dev/zero"), "/dev/zero: not a regular file"),
    Case("data-is-a-device", (T, "job.yaml"), "/dev/zero: not a regular file",
         job(data__train="/dev/zero")),

    # ---- sweeps: counted before they are built
    Case("grid-32-pow-6", (P, "sweep.yaml"), "grid: 1073741824 trials is more than 10000",
         sweep(grid=GRID_32_6), process=True),
    Case("grid-32-pow-6-validate", (V, "sweep.yaml"), "grid: 1073741824 trials",
         sweep(grid=GRID_32_6)),
    Case("grid-just-over", (V, "sweep.yaml"), "grid: 10100 trials is more than 10000",
         sweep(grid={"lora.rank": list(range(1, 102)), "train.iters": list(range(1, 101))})),
    Case("random-samples-huge", (V, "sweep.yaml"), "random.samples: Input should be less than or equal to 10000",
         sweep(random={"samples": 10**12, "params": {"train.learning_rate": {"uniform": [0.1, 0.2]}}})),
    Case("grid-times-samples", (S, "sweep.yaml"), "grid: 16000 trials is more than 10000",
         sweep(grid={"lora.rank": [4, 8]},
               random={"samples": 8000, "params": {"train.learning_rate": {"uniform": [0.1, 0.2]}}})),
    Case("grid-inf", (V, "sweep.yaml"), "grid.train.learning_rate[0]: Input should be a finite number",
         sweep(grid={"train.learning_rate": [float("inf")]})),
    Case("grid-nan", (V, "sweep.yaml"), "grid.train.learning_rate[0]: Input should be a finite number",
         sweep(grid={"train.learning_rate": [float("nan")]})),
    Case("uniform-overflow", (V, "sweep.yaml"), "Input should be a finite number (drew inf",
         sweep(grid={}, random={"samples": 1, "params": {
             "train.learning_rate": {"uniform": [-1.7e308, 1.7e308]}}})),
    Case("grid-key-newline", (V, "sweep.yaml"), "grid.a\\nb: unknown job key",
         sweep(grid={"a\nb": [1]})),
    Case("concurrency-huge", (V, "sweep.yaml"), "concurrency: Input should be less than or equal to 10000",
         sweep(concurrency=10**30)),
    Case("priority-past-int64", (S, "sweep.yaml"), "priority: Input should be less than or equal to 1000000",
         sweep(priority=2**70)),
    Case("retries-huge", (V, "sweep.yaml"), "retries: Input should be less than or equal to 100",
         sweep(retries=10**9)),

    # ---- bounded expansion: every list, one trial's job, all the trials' jobs (sized before
    # any is built: an 880 KB sweep made 2.2 MB per trial, ~22 GB in all)
    Case("lora-keys-5000", (V, "job.yaml"), "lora.keys: List should have at most 1024 items",
         job(lora__keys=["self_attn.q_proj"] * 5000)),
    Case("lora-keys-5000-train", (T, "job.yaml"), "lora.keys: List should have at most 1024 items",
         job(lora__keys=["self_attn.q_proj"] * 5000)),
    Case("lora-key-long", (V, "job.yaml"), "lora.keys.0: String should have at most 255 characters",
         job(lora__keys=["p" * 300])),
    Case("report-to-2000", (V, "job.yaml"), "report_to: List should have at most 1024 items",
         job(report_to=["tensorboard"] * 2000)),
    Case("report-to-sweep-2000", (V, "sweep.yaml"), "report_to: List should have at most 1024 items",
         sweep(report_to=["tensorboard"] * 2000)),
    Case("choice-2000", (V, "sweep.yaml"), "random.params.train.seed.choice: List should have at "
         "most 1024 items", sweep(grid={}, random={"samples": 1, "params": {
             "train.seed": {"choice": list(range(2000))}}})),
    Case("random-params-2000", (V, "sweep.yaml"), "random.params: Dictionary should have at most 1024",
         sweep(grid={}, random={"samples": 1, "params": {
             f"k{i}": {"uniform": [0, 1]} for i in range(2000)}})),
    Case("grid-keys-2000", (V, "sweep.yaml"), "grid: Dictionary should have at most 1024 items",
         sweep(grid={f"k{i}": [1] for i in range(2000)})),
    Case("grid-axis-20000", (V, "sweep.yaml"), "grid.train.seed: List should have at most 10000 items",
         sweep(grid={"train.seed": list(range(20000))})),
    Case("placement-2000", (V, "sweep.yaml"), "placement: Dictionary should have at most 1024 items",
         sweep(placement={f"k{i}": "v" for i in range(2000)})),
    Case("job-200-kb", (P, "sweep.yaml"), "job.yaml:1: (the base job): a trial's job would be about "
         "2", job(lora__keys=lora_keys(200))),
    Case("job-200-kb-single", (S, "job.yaml"), "job.yaml:1: (the base job): a trial's job would be",
         job(lora__keys=lora_keys(200))),
    Case("inline-job-200-kb", (V, "sweep.yaml"), "sweep.yaml:2: job: a trial's job would be about",
         {"sweep.yaml": edit({"name": "s", "job": {**JOB, "model": "model", "lora": {
             "keys": lora_keys(200)}}}, {})}),
    Case("grid-value-200-kb", (V, "sweep.yaml"), "grid.lora.keys: a trial's job would be about",
         sweep(grid={"lora.keys": [["self_attn.q_proj"], lora_keys(200)]})),
    Case("expands-to-gb", (S, "sweep.yaml"), "grid: 10000 trials of about 9",
         {**job(lora__keys=lora_keys(90)), **sweep(grid=GRID_100_100)}),
    Case("expands-to-gb-validate", (V, "sweep.yaml"), "more than 100000000; split the sweep",
         {**job(lora__keys=lora_keys(90)), **sweep(grid=GRID_100_100)}),

    # ---- jobs: numbers in range
    Case("seed-negative", (T, "job.yaml"), "train.seed: Input should be greater than or equal to 0",
         job(train__seed=-1)),
    Case("seed-past-uint32", (V, "job.yaml"), "train.seed: Input should be less than or equal to 4294967295",
         job(train__seed=2**64)),
    Case("max-seq-length-huge", (P, "job.yaml"), "data.max_seq_length: Input should be less than",
         job(data__max_seq_length=10**30)),
    Case("rank-huge", (V, "job.yaml"), "lora.rank: Input should be less than or equal to 65536",
         job(lora__rank=10**6)),
    Case("segment-size-huge", (V, "job.yaml"), "memory.segment_size: 1000000 is more than 1024 layers",
         job(memory__segment_size=10**6)),
    Case("learning-rate-inf", (T, "job.yaml"), "train.learning_rate: Input should be a finite number",
         job(train__learning_rate=float("inf"))),
    Case("budget-huge", (V, "job.yaml"), "memory.budget_gb: Input should be less than or equal to 65536",
         job(memory__budget_gb=1e12)),
    Case("iters-huge", (S, "job.yaml"), "train.iters: Input should be less than or equal to 1000000000",
         job(train__iters=10**12)),

    # ---- YAML itself
    Case("billion-laughs", (V, "sweep.yaml"), "sweep.yaml:2: YAML alias *a: aliases are not allowed",
         {"sweep.yaml": LAUGHS}, process=True),
    Case("billion-laughs-job-train", (T, "job.yaml"), "job.yaml:2: YAML alias", {"job.yaml": LAUGHS}),
    Case("alias-cluster-node", (V, "cluster.yaml"), "cluster.yaml:3: YAML alias *n",
         {"cluster.yaml": "nodes:\n  - &n {name: a, local: true, memory_gb: 1}\n  - *n\n"}),
    Case("alias-recursive", (V, "sweep.yaml"), "sweep.yaml:1: YAML alias *a",
         {"sweep.yaml": "name: &a [*a]\n"}),
    Case("alias-merge-key", (V, "job.yaml"), "job.yaml:3: YAML alias *d",
         {"job.yaml": "defaults: &d {iters: 2}\ntrain:\n  <<: *d\n"}),
    Case("alias-in-base-job", (P, "sweep.yaml"), "job.yaml:2: YAML alias",
         {"job.yaml": "name: &n j\nmodel: *n\n"}),
    Case("nesting-100", (V, "sweep.yaml"), "sweep.yaml:1: nested deeper than 32 levels",
         {"sweep.yaml": "grid: " + nested(100) + "\n"}),
    Case("nesting-10000", (V, "sweep.yaml"), "sweep.yaml:1:", {"sweep.yaml": "grid: " + nested(10000) + "\n"}),
    Case("nesting-mappings", (V, "job.yaml"), "nested deeper than 32 levels",
         {"job.yaml": "".join("  " * i + f"k{i}:\n" for i in range(40)) + "  " * 40 + "x: 1\n"}),
    Case("spec-1.5-mb", (V, "sweep.yaml"), "sweep.yaml: larger than 1000000 bytes",
         {"sweep.yaml": "name: s\nbase: job.yaml\n" + "#" * 1_500_000 + "\n"}),
    Case("spec-not-utf8", (V, "job.yaml"), "job.yaml: cannot read (not UTF-8",
         {"job.yaml": b"name: \xff\xfe\n"}),
    Case("spec-nul-byte", (V, "job.yaml"), "job.yaml:1: invalid YAML", {"job.yaml": "name: a\0b\n"}),
    Case("two-documents", (V, "sweep.yaml"), "invalid YAML", {"sweep.yaml": "name: a\n---\nname: b\n"}),
    Case("int-5000-digits", (V, "job.yaml"), "job.yaml: invalid YAML: Exceeds the limit (4300 digits)",
         {"job.yaml": "train:\n  iters: " + "9" * 5000 + "\n"}),
    Case("bad-timestamp", (V, "job.yaml"), "job.yaml: invalid YAML: month must be in 1..12",
         {"job.yaml": "name: 2001-13-45\n"}),
    Case("python-tag", (V, "job.yaml"), "invalid YAML",
         {"job.yaml": 'name: !!python/object/apply:os.system ["touch pwned"]\n'}),
    Case("unhashable-key", (V, "sweep.yaml"), "invalid YAML", {"sweep.yaml": "? [a, b]\n: 1\n"}),
    Case("empty-file", (V, "cluster.yaml"), "cluster.yaml:1: expected a mapping of keys, got an empty file",
         {"cluster.yaml": ""}),
    Case("top-level-list", (S, "sweep.yaml"), "sweep.yaml:1: expected a mapping of keys, got list",
         {"sweep.yaml": "- name: s\n"}),
    Case("key-with-escapes", (V, "job.yaml"), "job.yaml:1: \\x1b]0;pwned\\x07: unknown key",
         {"job.yaml": '"\\e]0;pwned\\a": 1\nmodel: model\ndata: {train: data/train.jsonl}\n'
                      'train: {iters: 1}\n'}),

    # ---- model folders: config.json
    Case("layers-billion", (V, "sweep.yaml"), "config.json: num_hidden_layers: 1000000000 is more than 1024",
         config={"num_hidden_layers": 10**9}),
    Case("layers-billion-plan", (P, "sweep.yaml"), "num_hidden_layers: 1000000000 is more than 1024",
         config={"num_hidden_layers": 10**9}),
    Case("layers-billion-submit", (S, "job.yaml"), "num_hidden_layers: 1000000000 is more than 1024",
         config={"num_hidden_layers": 10**9}, process=True),
    Case("layers-billion-train", (T, "job.yaml"), "num_hidden_layers: 1000000000 is more than 1024",
         config={"num_hidden_layers": 10**9}),
    Case("layers-billion-train-auto", (T, "job.yaml"), "num_hidden_layers: 1000000000 is more than 1024",
         job(memory__segment_size="auto"), config={"num_hidden_layers": 10**9}),
    Case("layers-billion-tune", ("tune", "--model", "model", "--seq-lens", "64"),
         "num_hidden_layers: 1000000000 is more than 1024", config={"num_hidden_layers": 10**9}),
    Case("model-type-traversal-tune", ("tune", "--model", "model", "--seq-lens", "64"),
         "model_type: '../../x' is not a plain name", config={"model_type": "../../x"}),
    Case("tune-seq-len-huge", ("tune", "--model", "model", "--seq-lens", "1024," + "9" * 11),
         "--seq-lens: 99999999999 is more than 16777216 tokens"),
    Case("hidden-huge", (P, "job.yaml"), "hidden_size: 1000000 is more than 65536",
         config={"hidden_size": 10**6}),
    Case("vocab-huge", (V, "job.yaml"), "vocab_size: 1000000000 is more than 4000000",
         config={"vocab_size": 10**9}),
    Case("intermediate-string", (V, "sweep.yaml"), "intermediate_size: expected a whole number, got 'big'",
         config={"intermediate_size": "big"}),
    Case("heads-zero", (P, "sweep.yaml"), "num_attention_heads: expected a whole number >= 1, got 0",
         config={"num_attention_heads": 0}),
    Case("kv-heads-negative", (V, "job.yaml"), "num_key_value_heads: expected a whole number >= 1, got -1",
         config={"num_key_value_heads": -1}),
    Case("head-dim-float", (V, "job.yaml"), "head_dim: expected a whole number, got 1.5",
         config={"head_dim": 1.5}),
    Case("layers-bool", (V, "job.yaml"), "num_hidden_layers: expected a whole number, got True",
         config={"num_hidden_layers": True}),
    Case("positions-huge", (P, "job.yaml"), "max_position_embeddings: 1099511627776 is more than",
         config={"max_position_embeddings": 2**40}),
    Case("experts-negative", (V, "job.yaml"), "num_local_experts: expected a whole number >= 0, got -4",
         config={"num_local_experts": -4}),
    Case("experts-huge", (V, "job.yaml"), "num_experts: 100000000 is more than 4096",
         config={"num_experts": 10**8}),
    Case("text-config-layers", (V, "sweep.yaml"), "text_config.num_hidden_layers: 1000000000 is more",
         config={"text_config": {"num_hidden_layers": 10**9}}),
    Case("model-type-traversal", (V, "sweep.yaml"), "model_type: '../../x' is not a plain name",
         config={"model_type": "../../x"}),
    Case("model-type-traversal-train", (T, "job.yaml"), "model_type: '../../x' is not a plain name",
         config={"model_type": "../../x"}),
    Case("model-type-missing", (P, "job.yaml"), "config.json: model_type: missing",
         config={"model_type": DELETE}),
    Case("model-type-int", (V, "job.yaml"), "model_type: 42 is not a plain name", config={"model_type": 42}),
    Case("config-not-json", (V, "sweep.yaml"), "config.json: not valid JSON",
         {"model/config.json": "{not json"}),
    Case("config-a-list", (T, "job.yaml"), "config.json: expected a JSON object, got list",
         {"model/config.json": "[1, 2]"}),
    Case("config-nan", (V, "job.yaml"), "config.json: not valid JSON (NaN is not a JSON number)",
         {"model/config.json": '{"model_type": "qwen3", "rope_theta": NaN}'}),
    Case("config-nested", (P, "job.yaml"), "config.json: not valid JSON (nested deeper than 32 levels)",
         {"model/config.json": '{"model_type": "qwen3", "x": ' + nested(100000) + "}"}),
    Case("config-17-mb", (V, "job.yaml"), "config.json: larger than 16000000 bytes",
         {"model/config.json": '{"model_type": "qwen3", "pad": "' + "x" * 17_000_000 + '"}'}),
    Case("config-missing", (V, "sweep.yaml"), "model: no config.json in", {"model/config.json": None}),
    Case("config-not-utf8", (P, "job.yaml"), "config.json: not valid JSON (not UTF-8",
         {"model/config.json": b'{"model_type": "\xff"}'}),
    Case("safetensors-bad-shape", (P, "job.yaml"), "model.safetensors: not a safetensors file",
         {"model/model.safetensors": safetensors({"w": {"dtype": "F32", "shape": "abc",
                                                        "data_offsets": [0, 0]}})}),

    # ---- data files (JSONL): bounded rows, errors at file:line
    Case("row-5-mb", (P, "job.yaml"), "train.jsonl:2: row is longer than 1000000 bytes",
         rows('{"text": "' + "x" * 5_000_000 + '"}\n')),
    Case("row-5-mb-submit", (S, "sweep.yaml"), "train.jsonl:2: row is longer than 1000000 bytes",
         rows('{"text": "' + "x" * 5_000_000 + '"}\n'), process=True),
    Case("row-5-mb-train", (T, "job.yaml"), "train.jsonl:2: row is longer than 1000000 bytes",
         rows('{"text": "' + "x" * 5_000_000 + '"}\n')),
    Case("row-5-mb-train-auto", (T, "job.yaml"), "train.jsonl:2: row is longer than 1000000 bytes",
         {**job(memory__segment_size="auto"), **rows('{"text": "' + "x" * 5_000_000 + '"}\n')}),
    Case("valid-row-5-mb", (P, "job.yaml"), "valid.jsonl:2: row is longer than 1000000 bytes",
         rows('{"text": "' + "x" * 5_000_000 + '"}\n', name="data/valid.jsonl")),
    Case("row-no-newline-ever", (T, "job.yaml"), "train.jsonl:1: row is longer than 1000000 bytes",
         {"data/train.jsonl": "x" * 3_000_000}),
    Case("row-nested-100000", (S, "job.yaml"), "train.jsonl:2: not valid JSON (nested deeper than 32",
         rows(nested(100000) + "\n")),
    Case("row-nested-40", (T, "job.yaml"), "train.jsonl:2: not valid JSON (nested deeper than 32",
         rows('{"text": ' + nested(40, '"x"') + "}\n")),
    Case("row-nan", (P, "job.yaml"), "train.jsonl:2: not valid JSON (NaN is not a JSON number)",
         rows('{"text": NaN}\n')),
    Case("row-float-overflow", (P, "job.yaml"), "train.jsonl:2: not valid JSON (1e5000 is out of range)",
         rows('{"text": 1e5000}\n')),
    Case("row-not-utf8", (T, "job.yaml"), "train.jsonl:2: not UTF-8",
         {"data/train.jsonl": GOOD_ROW.encode() + b'{"text": "\xff"}\n'}),
    Case("row-key-newline", (P, "job.yaml"), "train.jsonl:2: row has none of 'text'",
         rows('{"a\\nb": "x"}\n')),
    Case("row-messages-escape", (P, "job.yaml"), "train.jsonl:2: with mask_prompt the last message",
         rows('{"messages": [{"role": "user", "content": "hi"}, {"role": "\\u001b[2J", '
              '"content": "x"}]}\n')),

    # ---- cluster files
    Case("node-name-100", (V, "cluster.yaml"), "nodes.0.name: '" + "n" * 80,
         node(name="n" * 100)),
    Case("node-name-option", (V, "cluster.yaml"), "nodes.0.name: '-oProxyCommand' is not a Ray label",
         node(name="-oProxyCommand")),
    Case("node-name-slash", (P, "sweep.yaml", "--cluster", "cluster.yaml"), "nodes.0.name: String should match",
         node(name="a/b")),
    Case("host-ssh-option", (S, "sweep.yaml", "--cluster", "cluster.yaml"), "nodes.0.host: "
         "'-oProxyCommand=sh -c evil' is not a host", node(host="-oProxyCommand=sh -c evil", local=False),
         process=True),
    Case("host-empty", (V, "cluster.yaml"), "nodes.0.host: '' is not a host",
         node(host="", local=False)),
    Case("host-newline", (V, "cluster.yaml"), "nodes.0.host: 'mac\\nrm' is not a host",
         node(host="mac\nrm", local=False)),
    Case("memory-zero", (V, "cluster.yaml"), "nodes.0.memory_gb: Input should be greater than 0",
         node(memory_gb=0)),
    Case("memory-huge", (V, "cluster.yaml"), "nodes.0.memory_gb: Input should be less than or equal to 65536",
         node(memory_gb=1e12)),
    Case("memory-inf", (P, "sweep.yaml", "--cluster", "cluster.yaml"),
         "nodes.0.memory_gb: Input should be a finite number", node(memory_gb=float("inf"))),
    Case("memory-nan", (V, "cluster.yaml"), "nodes.0.memory_gb: Input should be a finite number",
         node(memory_gb=float("nan"))),
    Case("port-zero", (V, "cluster.yaml"), "head.port: Input should be greater than or equal to 1",
         {"cluster.yaml": "head: {port: 0}\nnodes: [{name: a, local: true, memory_gb: 1}]\n"}),
    Case("port-70000", (S, "sweep.yaml", "--cluster", "cluster.yaml"),
         "head.port: Input should be less than or equal to 65535",
         {"cluster.yaml": "head: {port: 70000}\nnodes: [{name: a, local: true, memory_gb: 1}]\n"}),
    Case("head-address-option", (V, "cluster.yaml"), "head.address: '-x' is not a host",
         {"cluster.yaml": "head: {address: -x}\nnodes: [{name: a, local: true, memory_gb: 1}]\n"}),
    Case("head-stores-nul", (V, "cluster.yaml"), "head.stores: path",
         {"cluster.yaml": 'head: {stores: "a\\0b"}\nnodes: [{name: a, local: true, memory_gb: 1}]\n'}),
    Case("label-value-comma", (V, "cluster.yaml"), "labels.room: 'a,b=c' is not a Ray label",
         node(labels={"room": "a,b=c"})),
    Case("label-key-long", (V, "cluster.yaml"), "is not a Ray label", node(labels={"k" * 100: "v"})),
    Case("chip-space", (V, "cluster.yaml"), "nodes.0.chip: 'm2 ultra' is not a Ray label",
         node(chip="m2 ultra")),
    Case("cluster-nesting", (V, "cluster.yaml"), "nested deeper than 32 levels",
         {"cluster.yaml": "nodes: " + nested(50) + "\n"}),
]
