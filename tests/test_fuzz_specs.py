"""Property-based fuzzing of the spec loaders (job, sweep, cluster YAML) and of the
JSONL data loader: whatever the document, it loads as valid or is refused with
our one-line bad-input error (SpecError / DataError), never another exception
and never past the per-case deadline.

Documents are random nestings of dicts, lists and scalars with keys drawn from
the real schemas' key names plus junk, valid specs with random keys replaced or
removed, and either of those with YAML-significant characters spliced into the
text. Derandomized and without a database, so a run is the same everywhere.
"""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from segctl.engine.data import DataError, load_dataset
from segctl.schemas import SpecError
from segctl.schemas.cluster import ClusterSpec, HeadSpec, NodeSpec, PlannerSpec, load_cluster
from segctl.schemas.job import JobSpec, load_job
from segctl.schemas.search import DISTRIBUTIONS, RandomSpec
from segctl.schemas.spec import load_spec
from segctl.schemas.sweep import SweepSpec, job_keys, load_sweep
from tests.hostile.cases import CLUSTER, JOB, SWEEP, Case, lay_out

# 500 examples a test keep the module near 10 s on 2 cores; a case past 5 s is a failure.
FUZZ = settings(max_examples=500, deadline=timedelta(seconds=5), derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

KEYS = sorted({*job_keys(), *JobSpec.model_fields, *SweepSpec.model_fields, *RandomSpec.model_fields,
               *DISTRIBUTIONS, *ClusterSpec.model_fields, *HeadSpec.model_fields,
               *PlannerSpec.model_fields, *NodeSpec.model_fields, "lambda", "beta", "text", "prompt",
               "completion", "messages", "role", "content", "chosen", "rejected", "system"})

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-2**80, max_value=2**80),
    st.floats(), st.text(max_size=12), st.sampled_from(["auto", "sft", "orpo", "dpo", "model",
                                                        "job.yaml", "data/train.jsonl", "~", ""]))
keys = st.one_of(st.sampled_from(KEYS), st.text(max_size=8))
documents = st.recursive(scalars, lambda kids: st.one_of(
    st.lists(kids, max_size=4), st.dictionaries(keys, kids, max_size=5)), max_leaves=20)


@st.composite
def mutated(draw, base: dict):
    """A valid spec with a few of its keys (at any depth) set to random values or removed."""
    doc = json.loads(json.dumps(base))
    for _ in range(draw(st.integers(0, 3))):
        node = doc
        while True:
            key = draw(st.sampled_from(sorted(node, key=str))) if isinstance(node, dict) and node \
                else None
            if key is None or not isinstance(node[key], dict) or draw(st.booleans()):
                break
            node = node[key]
        if not isinstance(node, dict):
            continue
        if key is not None and draw(st.booleans()):
            del node[key]
        else:
            node[key if key is not None else draw(keys)] = draw(documents)
    return doc


@st.composite
def yaml_text(draw, docs):
    """A document as YAML, sometimes with YAML-significant characters spliced in."""
    text = yaml.safe_dump(draw(docs), sort_keys=False)
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(text)))
        junk = draw(st.text(alphabet="&*!|>{}[]:-#'\"\n\t ,?%@`\\<=", min_size=1, max_size=4))
        text = text[:at] + junk + text[at:]
    return text


@pytest.fixture(scope="module")
def folder(demo_dir, tmp_path_factory):
    return lay_out(Case("fuzz", (), ""), demo_dir, tmp_path_factory.mktemp("fuzz") / "project")


def assert_loads_or_one_line(loader, path):
    try:
        loader(path)
    except SpecError as e:
        assert e.problems, "a SpecError without a problem"
        for p in e.problems:
            assert p and "\n" not in p and "\r" not in p and p.isprintable(), p
            assert p.startswith(str(path.parent)) or p.startswith(str(path)), p


@FUZZ
@given(text=yaml_text(st.one_of(documents, mutated(JOB))))
def test_job_loader(folder, text):
    path = folder / "fuzz-job.yaml"
    path.write_text(text)
    assert_loads_or_one_line(load_job, path)


@FUZZ
@given(text=yaml_text(st.one_of(documents, mutated(SWEEP), mutated({**SWEEP, "random": {
    "seed": 1, "samples": 2, "params": {"train.learning_rate": {"log_uniform": [1e-5, 1e-3]}}}}),
    mutated({"name": "inline", "job": JOB, "grid": {"train.iters": [1, 2]}}))))
def test_sweep_loader(folder, text):
    path = folder / "fuzz-sweep.yaml"
    path.write_text(text)
    assert_loads_or_one_line(load_sweep, path)


@FUZZ
@given(text=yaml_text(st.one_of(documents, mutated(CLUSTER), mutated({
    "head": {"address": "auto", "port": 6380, "stores": "stores"}, "planner": {"margin": 0.2},
    "nodes": [{"name": "a", "host": "lab@mac", "chip": "m2", "memory_gb": 8,
               "labels": {"room": "lab"}}]}))))
def test_cluster_loader(folder, text):
    path = folder / "fuzz-cluster.yaml"
    path.write_text(text)
    assert_loads_or_one_line(load_cluster, path)


@FUZZ
@given(text=yaml_text(documents))
def test_any_spec_through_load_spec(folder, text):
    path = folder / "fuzz-spec.yaml"
    path.write_text(text)
    assert_loads_or_one_line(load_spec, path)


# ------------------------------------------------------------------ data rows

texts = st.text(max_size=30)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"])
                                           | st.text(max_size=5), "content": texts | documents}),
                    max_size=3)
rows = st.one_of(
    documents,
    st.fixed_dictionaries({"text": texts | documents}),
    st.fixed_dictionaries({"prompt": texts | documents, "completion": texts | documents}),
    st.fixed_dictionaries({"messages": messages | documents}),
    st.fixed_dictionaries({"prompt": texts | messages, "chosen": texts | messages | documents,
                           "rejected": texts | messages},
                          optional={"system": texts | documents, "preference_score": scalars}))


@st.composite
def jsonl(draw):
    lines = [json.dumps(draw(rows)) for _ in range(draw(st.integers(1, 3)))]
    if draw(st.booleans()):   # raw text: broken JSON, NaN, deep nesting, odd characters
        i = draw(st.integers(0, len(lines) - 1))
        at = draw(st.integers(0, len(lines[i])))
        junk = draw(st.one_of(st.text(alphabet='{}[]":,\\nNaInfty0e-', max_size=6),
                              st.integers(33, 200).map(lambda n: "[" * n)))
        lines[i] = lines[i][:at] + junk + lines[i][at:]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def tokenizer(folder):
    from mlx_lm.utils import load_tokenizer
    return load_tokenizer(folder / "model")


@FUZZ
@given(text=jsonl(), method=st.sampled_from(["sft", "orpo", "dpo"]), mask_prompt=st.booleans(),
       max_seq_length=st.integers(2, 64), overlong=st.sampled_from(["truncate", "skip"]))
def test_data_rows(folder, tokenizer, text, method, mask_prompt, max_seq_length, overlong):
    path = folder / "fuzz.jsonl"
    path.write_text(text, encoding="utf-8")
    try:
        load_dataset(path, tokenizer, method=method, mask_prompt=mask_prompt,
                     max_seq_length=max_seq_length, overlong=overlong)
    except DataError as e:
        msg = str(e)
        assert msg.startswith(f"{path}") and "\n" not in msg and msg.isprintable(), msg
