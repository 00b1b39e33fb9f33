"""Batches and exact packing in the specs, the CLI and the planner: mlx-lm's config
keys named by their segctl keys, `data.pack: true` refused on a family the engine
cannot pack exactly, a step planned at its longest packed sequence, `segctl plan`
naming the largest batch that fits, and sweeps over train.batch_size."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from segctl.orchestrator import planner
from segctl.orchestrator.planner import RowLengths, step_tokens
from segctl.schemas.errors import SpecError
from segctl.schemas.job import JobSpec, load_job
from segctl.schemas.mlx_lm_keys import MLX_LM_KEYS
from segctl.schemas.sweep import job_keys, load_sweep
from tests.conftest import assert_one_line_error, edit_job, segctl
from tests.test_train_cli import copy_demo


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def problems(loader, path) -> list[str]:
    with pytest.raises(SpecError) as e:
        loader(path)
    return e.value.problems


JOB = """\
model: m
data:
  train: t.jsonl
train:
  iters: 3
"""


# ------------------------------------------------------------------ 1. mlx-lm's keys

def test_the_table_holds_mlx_lm_keys_and_names_segctl_keys_that_exist():
    """Every key of the table is one of mlx_lm.lora's config keys, and every segctl
    key it names (a dotted job key) is one a job has: the table cannot drift from
    either side unnoticed."""
    from mlx_lm import lora
    theirs = set(lora.CONFIG_DEFAULTS) | {a.dest for a in lora.build_parser()._actions}
    assert set(MLX_LM_KEYS) <= theirs, set(MLX_LM_KEYS) - theirs
    ours = set(job_keys())
    for key, says in MLX_LM_KEYS.items():
        assert says.startswith(("is segctl's ", "has no segctl key (")), (key, says)
        for named in re.findall(r"\b[a-z_]+\.[a-z_]+\b", says):
            assert named in ours, (key, named)
        assert key not in ours   # a key segctl has at its place is never unknown


@pytest.mark.parametrize("key", sorted(MLX_LM_KEYS))
def test_each_mlx_lm_key_at_the_top_of_a_job_names_its_segctl_key(tmp_path, key):
    path = write(tmp_path / "job.yaml", JOB + f"{key}: 1\n")
    assert problems(load_job, path) == [
        f"{path}:6: {key}: unknown key: mlx-lm's {key} {MLX_LM_KEYS[key]}"]


def test_mlx_lm_keys_inside_a_section_and_keys_without_a_meaning(tmp_path):
    path = write(tmp_path / "job.yaml", JOB + "  grad_accumulation_steps: 4\n")
    assert problems(load_job, path) == [
        f"{path}:6: train.grad_accumulation_steps: unknown key: mlx-lm's grad_accumulation_steps "
        "is segctl's train.grad_accumulation"]
    path = write(tmp_path / "job.yaml", JOB.replace("  train: t.jsonl\n",
                                                    "  train: t.jsonl\n  iters: 5\n"))
    assert problems(load_job, path) == [
        f"{path}:4: data.iters: unknown key: mlx-lm's iters is segctl's train.iters"]
    # its flags' spelling too
    path = write(tmp_path / "job.yaml", JOB + "batch-size: 4\n")
    assert problems(load_job, path) == [
        f"{path}:6: batch-size: unknown key: mlx-lm's batch-size is segctl's train.batch_size"]
    # no segctl meaning: the plain unknown key, with its did-you-mean
    path = write(tmp_path / "job.yaml", JOB + "  steps_per_report: 10\n")
    (p,) = problems(load_job, path)
    assert p.startswith(f"{path}:6: train.steps_per_report: unknown key") and "mlx-lm" not in p
    path = write(tmp_path / "job.yaml", JOB + "  iter: 10\n")
    assert problems(load_job, path) == [
        f"{path}:6: train.iter: unknown key; did you mean 'iters'?"]


def test_mlx_lm_keys_in_a_sweep_base_inline_job_and_axes(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "t.jsonl").write_text("")
    write(tmp_path / "job.yaml", JOB + "  steps_per_eval: 5\n")
    sweep = write(tmp_path / "sweep.yaml", """\
name: s
base: job.yaml
grid:
  train.grad_accumulation_steps: [1, 2]
  lora_parameters.rank: [4, 8]
random:
  samples: 1
  params:
    learning_rate: {log_uniform: [1.0e-5, 1.0e-3]}
""")
    assert problems(load_sweep, sweep) == [
        f"{sweep}:4: grid.train.grad_accumulation_steps: unknown job key: mlx-lm's "
        "grad_accumulation_steps is segctl's train.grad_accumulation",
        f"{sweep}:5: grid.lora_parameters.rank: unknown job key: mlx-lm's lora_parameters is "
        "segctl's lora (rank, scale, dropout, keys)",
        f"{sweep}:9: random.params.learning_rate: unknown job key: mlx-lm's learning_rate is "
        "segctl's train.learning_rate",
        f"{tmp_path / 'job.yaml'}:6: train.steps_per_eval: unknown key: mlx-lm's steps_per_eval "
        "is segctl's train.eval_every"]
    inline = write(tmp_path / "inline.yaml", """\
name: s
job:
  model: m
  data: {train: t.jsonl}
  train: {iters: 3, save_every: 10}
grid:
  train.lerning_rate: [1]
""")
    assert problems(load_sweep, inline) == [
        f"{inline}:5: job.train.save_every: unknown key: mlx-lm's save_every is segctl's "
        "train.checkpoint_every",
        f"{inline}:7: grid.train.lerning_rate: unknown job key; did you mean 'train.learning_rate'?"]


def test_segctl_validate_says_it_in_one_line(demo_dir, tmp_path):
    job = copy_demo(demo_dir, tmp_path, train={"grad_accumulation_steps": 4})
    assert_one_line_error(segctl("validate", job), f"{job}:",
                          "train.grad_accumulation_steps: unknown key: mlx-lm's "
                          "grad_accumulation_steps is segctl's train.grad_accumulation")
    job = copy_demo(demo_dir, tmp_path, lora_parameters={"rank": 8})
    assert_one_line_error(segctl("validate", job), "lora_parameters: unknown key: mlx-lm's "
                          "lora_parameters is segctl's lora (rank, scale, dropout, keys)")
    copy_demo(demo_dir, tmp_path)   # a good base job again
    sweep = write(tmp_path / "sweep.yaml", "name: s\nbase: job.yaml\ngrid:\n  batch_size: [1, 2]\n")
    assert_one_line_error(segctl("validate", sweep), f"{sweep}:4: grid.batch_size: unknown job "
                          "key: mlx-lm's batch_size is segctl's train.batch_size")


# ------------------------------------------------------------------ 2. pack: true refused

# Families the engine cuts into segments (check_family passes on a tiny config) but
# whose rows it may not pack; the test takes the first that PACKABLE_FAMILIES lacks.
UNPACKABLE_CANDIDATES = ("exaone4", "afmoe", "bitnet", "olmo_hybrid", "qwen3_next", "step3p5")


def unpackable_model(tmp_path: Path) -> tuple[Path, str]:
    from segctl.schemas.families import PACKABLE_FAMILIES
    from tests.zoo import tiny_config
    family = next((f for f in UNPACKABLE_CANDIDATES if f not in PACKABLE_FAMILIES), None)
    if family is None:
        pytest.skip("every candidate family packs now: add one that does not")
    folder = tmp_path / family
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(tiny_config(family)))
    (folder / "model.safetensors").write_bytes(b"\0" * 16)   # never read
    return folder, family


def test_pack_true_on_a_family_that_cannot_pack_stops_validate_plan_submit_and_tune(
        demo_dir, tmp_path):
    folder, family = unpackable_model(tmp_path)
    job = copy_demo(demo_dir, tmp_path, model=str(folder), data={"pack": True},
                    train={"batch_size": 4})
    line = next(i for i, t in enumerate(job.read_text().splitlines(), 1) if "pack: true" in t)
    home = tmp_path / "home"
    cmds = (["validate", job], ["plan", job], ["submit", job, "--detach"],
            ["tune", "--model", folder, "--job", job, "--seq-lens", "64"])
    # the four processes at once: each waits on its start-up more than on a core
    with ThreadPoolExecutor(len(cmds)) as pool:
        procs = list(pool.map(lambda cmd: segctl(*cmd, env={"SEGCTL_HOME": home}), cmds))
    for cmd, proc in zip(cmds, procs):
        err = assert_one_line_error(proc)
        assert err == (f"segctl: {job}:{line}: data.pack: true: model type {family} cannot be "
                       "packed exactly (use pack: auto, which trains it unpacked, or pack: "
                       "false)"), (cmd, err)
    assert not home.exists() and not (tmp_path / "out").exists()
    # auto trains it unpacked: valid, and planned at its longest row
    edit_job(job, data={"pack": "auto"})
    assert segctl("validate", job).returncode == 0


def test_a_sweep_axis_that_packs_an_unpackable_family_is_refused_where_written(
        demo_dir, tmp_path):
    folder, family = unpackable_model(tmp_path)
    copy_demo(demo_dir, tmp_path, model=str(folder), train={"batch_size": 2})
    sweep = write(tmp_path / "sweep.yaml",
                  "name: s\nbase: job.yaml\ngrid:\n  data.pack:\n    - false\n    - true\n")
    assert_one_line_error(segctl("validate", sweep),
                          f"{sweep}:6: grid.data.pack[1]: true: model type {family} cannot be "
                          "packed exactly")
    # the same job on a family that packs is fine
    copy_demo(demo_dir, tmp_path, train={"batch_size": 2})
    proc = segctl("validate", sweep)
    assert proc.returncode == 0, proc.stderr


def test_family_packs_reads_the_wrapper_its_text_model_and_mlx_lms_remapping(tmp_path):
    from segctl.schemas.families import PACKABLE_FAMILIES

    def folder(name, config):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        return str(d)

    packable = sorted(PACKABLE_FAMILIES)[0]
    assert planner.family_packs(folder("plain", {"model_type": packable}))
    assert not planner.family_packs(folder("unknown", {"model_type": "no_such_family"}))
    wrapped = folder("wrapped", {"model_type": "no_such_wrapper",
                                 "text_config": {"model_type": packable}})
    assert planner.model_types(wrapped) == ["no_such_wrapper", packable]
    assert planner.family_packs(wrapped)
    if "llama" in PACKABLE_FAMILIES:   # mlx-lm runs a "mistral" config as its llama module
        assert planner.family_packs(folder("mistral", {"model_type": "mistral"}))


# ------------------------------------------------------------------ 3. step_tokens

def a_job(**data) -> JobSpec:
    return JobSpec(model="m", data={"train": "t.jsonl", "max_seq_length": 100, **data},
                   train={"iters": 1, "batch_size": 4})


def with_(job: JobSpec, **sections) -> JobSpec:
    return job.model_copy(update={k: getattr(job, k).model_copy(update=v)
                                  for k, v in sections.items()})


ROWS = RowLengths((90, 40, 30, 20, 10, 5))


def test_step_tokens_is_the_packed_micro_batch_or_its_rows_side_by_side():
    job = a_job(pack=True)
    assert step_tokens(job, ROWS) == 100                      # min(100, 90 + 40 + 30 + 20)
    assert step_tokens(job, ROWS, batch_size=2) == 100        # min(100, 90 + 40)
    assert step_tokens(with_(job, data={"pack_length": 400}), ROWS) == 180
    assert step_tokens(with_(job, data={"pack_length": 400}), ROWS, batch_size=3) == 160
    assert step_tokens(job, RowLengths((30, 20, 10, 5, 1))) == 65   # the 4 longest together
    assert step_tokens(job, ROWS, batch_size=1) == 90        # one row: nothing to pack
    # unpacked, the rows run side by side: [4, 90] is over pack_length, so the
    # longest runs alone and the others as [3, 40]; at 400 tokens, [4, 90]
    apart = with_(job, data={"pack": False})
    assert step_tokens(apart, ROWS) == 100
    assert step_tokens(with_(apart, data={"pack_length": 400}), ROWS) == 360
    assert step_tokens(with_(apart, data={"pack_length": 400}), ROWS, batch_size=2) == 180
    # with LoRA dropout they run one after the other: the longest row
    assert step_tokens(with_(apart, lora={"dropout": 0.1}), ROWS) == 90
    # auto: packed only where the family packs and lora.dropout is 0
    auto = with_(job, data={"pack": "auto"})
    assert step_tokens(auto, ROWS, packable=True) == 100
    assert step_tokens(auto, ROWS, packable=False) == 100
    assert step_tokens(with_(auto, lora={"dropout": 0.1}), ROWS, packable=True) == 90
    # a row longer than pack_length runs alone: the step holds it whole
    assert step_tokens(job, RowLengths((150, 40, 30, 20))) == 150
    # two-branch preference rows are never packed; the packed ones are. Their two
    # branches run side by side where [2, branch] fits pack_length
    assert step_tokens(job, RowLengths((30, 20), branched=70)) == 70
    assert step_tokens(job, RowLengths((60, 50), branched=70)) == 100
    assert step_tokens(job, RowLengths((30, 20), branched=40)) == 100
    assert planner.longest_row(job, RowLengths((30, 20), branched=70)) == 70
    # on several nodes a rank's micro-batch is at most its share of the step's rows:
    # 4 rows on 2 nodes pack as 2 (90 + 40), on 4 nodes as 1; accumulation deals
    # out every micro-batch's rows (2 x 4 rows on 4 nodes: 2 each)
    wide = with_(job, data={"pack_length": 400})
    two = with_(wide, distributed={"nodes": 2})
    assert step_tokens(two, ROWS) == step_tokens(wide, ROWS, batch_size=2) == 130
    assert step_tokens(with_(wide, distributed={"nodes": 4}), ROWS) == 90
    assert step_tokens(with_(wide, distributed={"nodes": 4, "min_nodes": 2}), ROWS) == 130
    assert step_tokens(with_(wide, distributed={"nodes": 4}, train={"grad_accumulation": 2}),
                       ROWS) == 130


def test_step_tokens_bounds_the_engines_packed_sequences(demo_dir):
    """The engine packs a micro-batch's rows first-fit, longest first, into
    sequences of at most pack_length (engine/plans.py first_fit): whichever rows make
    the micro-batch, no sequence is longer than step_tokens."""
    import random

    from segctl.engine.plans import first_fit
    base = load_job(demo_dir / "job.yaml")
    lengths = planner.row_lengths(base)
    assert planner.longest_row(base, lengths) == planner.longest_row(base) == lengths.streams[0]
    rng = random.Random(0)
    for b, pack_length in ((2, None), (4, None), (16, None), (16, 1024)):
        job = base.model_copy(update={
            "train": base.train.model_copy(update={"batch_size": b}),
            "data": base.data.model_copy(update={"pack": True, "pack_length": pack_length})})
        bound = step_tokens(job, lengths)
        cap = pack_length or job.data.max_seq_length
        assert bound == min(cap, sum(lengths.streams[:b]))
        worst = [lengths.streams[:b]] + [rng.sample(lengths.streams, b) for _ in range(50)]
        longest = max(sum(seq) for rows in worst for seq in first_fit(rows, lambda n: n, cap))
        assert longest <= bound
        if sum(lengths.streams[:b]) <= cap:   # the longest rows fit one sequence: it is that
            assert longest == bound


def test_prepare_reads_the_rows_once_and_plans_each_trial_at_its_step(demo_dir, tmp_path,
                                                                     monkeypatch):
    from segctl.orchestrator.submit import prepare
    copy_demo(demo_dir, tmp_path, data={"pack": True})
    sweep = write(tmp_path / "sweep.yaml", "name: s\nbase: job.yaml\ngrid:\n"
                  "  train.batch_size: [1, 4]\n  lora.rank: [4, 8]\n")
    reads = []
    real = planner.row_lengths
    monkeypatch.setattr(planner, "row_lengths", lambda job: reads.append(job) or real(job))
    tokens: dict = {}
    payload = prepare(load_sweep(sweep), {}, tokens)
    assert len(reads) == 1
    lengths = real(reads[0])
    seq = {(t["params"]["train.batch_size"], t["params"]["lora.rank"]): t["seq_len"]
           for t in payload["trials"]}
    assert seq[1, 4] == seq[1, 8] == lengths.streams[0]
    assert seq[4, 4] == seq[4, 8] == min(256, sum(lengths.streams[:4]))
    name = next(t["name"] for t in payload["trials"] if t["params"]["train.batch_size"] == 4)
    assert [tokens[name](b) for b in (1, 2, 3)] == [lengths.streams[0]] + [
        min(256, sum(lengths.streams[:b])) for b in (2, 3)]


# ------------------------------------------------------------------ 4. the largest batch that fits

def test_largest_batch_bisects_to_the_last_batch_that_fits():
    from segctl.orchestrator.submit import largest_batch
    tokens = lambda b: 10 * b
    assert largest_batch(8, tokens, lambda L: L <= 35) == 3
    assert largest_batch(8, tokens, lambda L: L <= 70) == 7
    assert largest_batch(8, tokens, lambda L: L < 10) is None   # not even one row
    assert largest_batch(8, lambda b: 50, lambda L: L <= 70) is None   # rows that do not pack
    assert largest_batch(2, tokens, lambda L: L <= 10) == 1


def plan_json(sweep: Path, cluster: Path, home: Path) -> list[dict]:
    proc = segctl("plan", sweep, "--cluster", cluster, "--json", env={"SEGCTL_HOME": home})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_plan_names_the_largest_batch_that_fits(demo_dir, tmp_path):
    """A batch that does not fit a node class: the reason names the largest batch
    whose step would (planned at its own step_tokens); none where even one row
    does not fit."""
    from segctl.schemas.defaults import DEFAULT_MARGIN
    job = load_job(copy_demo(demo_dir, tmp_path, data={"pack": True},
                             train={"batch_size": 4}, memory={"segment_size": 1}))
    info = planner.model_info(job.model)
    lengths = planner.row_lengths(job)
    gb = {b: planner.plan(info, job, seq_len=step_tokens(job, lengths, batch_size=b),
                          budget_gb=1e6).predicted_gb for b in (1, 2, 3, 4)}
    assert gb[1] < gb[2] < gb[3] < gb[4], gb
    memory = (gb[2] + gb[3]) / 2 / (1 - DEFAULT_MARGIN)   # batch 2 fits, 3 does not
    cluster = write(tmp_path / "cluster.yaml", "nodes:\n"
                    f"  - {{name: small, local: true, chip: m1, memory_gb: {memory:.6g}}}\n"
                    f"  - {{name: tiny, local: true, chip: m2, memory_gb: {gb[1] / 2:.6g}}}\n"
                    "  - {name: large, local: true, chip: m3, memory_gb: 64}\n")
    sweep = write(tmp_path / "sweep.yaml", "name: s\nbase: job.yaml\ngrid:\n"
                  "  data.pack: [true, false]\n")
    home = tmp_path / "home"
    rows = {r["params"]["data.pack"]: r for r in plan_json(sweep, cluster, home)}
    packed, unpacked = rows[True]["classes"], rows[False]["classes"]
    assert rows[True]["seq_len"] == step_tokens(job, lengths)
    # unpacked, the rows run side by side: [4, longest] at most, within pack_length
    apart = job.model_copy(update={"data": job.data.model_copy(update={"pack": False})})
    assert rows[False]["seq_len"] == step_tokens(apart, lengths) > lengths.streams[0]
    small = next(c for c in packed if c.startswith("m1/"))
    tiny = next(c for c in packed if c.startswith("m2/"))
    large = next(c for c in packed if c.startswith("m3/"))
    assert not packed[small]["fits"] and packed[small]["reason"].endswith(
        "; the largest batch that fits is 2 rows (train.batch_size: 2, or raise "
        "train.grad_accumulation)"), packed[small]
    assert not packed[tiny]["fits"] and "largest batch" not in packed[tiny]["reason"]
    assert packed[large]["fits"] and "largest batch" not in packed[large]["reason"]
    assert "largest batch" not in unpacked[tiny]["reason"]   # not even one row fits
    # the table prints (its cells wrap the reason), and nothing was written
    proc = segctl("plan", sweep, "--cluster", cluster, env={"SEGCTL_HOME": home})
    assert proc.returncode == 0 and "does not fit" in proc.stdout, proc.stderr
    assert not home.exists()


# ------------------------------------------------------------------ 5. sweeps over the batch

def test_a_sweep_over_train_batch_size_validates_and_plans(demo_dir, tmp_path):
    copy_demo(demo_dir, tmp_path)
    sweep = write(tmp_path / "sweep.yaml", "name: s\nbase: job.yaml\ngrid:\n"
                  "  train.batch_size: [1, 4]\n  data.pack: [auto, false]\n")
    proc = segctl("validate", sweep)
    assert proc.returncode == 0 and "sweep of 4 trials" in proc.stdout, proc.stderr
    s = load_sweep(sweep)
    assert {(t.job.train.batch_size, t.job.data.pack) for t in s.trials} == {
        (1, "auto"), (1, False), (4, "auto"), (4, False)}
    cluster = write(tmp_path / "cluster.yaml",
                    "nodes:\n  - {name: a, local: true, chip: m1, memory_gb: 64}\n")
    rows = plan_json(sweep, cluster, tmp_path / "home")
    lengths = planner.row_lengths(s.trials[0].job)
    seq = {(r["params"]["train.batch_size"], r["params"]["data.pack"]): r["seq_len"] for r in rows}
    # the demo is qwen3, which packs: auto packs batch 4
    assert seq == {(1, "auto"): lengths.streams[0], (1, False): lengths.streams[0],
                   (4, "auto"): min(256, sum(lengths.streams[:4])),
                   (4, False): min(256, 4 * lengths.streams[0])}   # side by side
    assert all(c["fits"] for r in rows for c in r["classes"].values())
    bad = write(tmp_path / "bad.yaml", "name: s\nbase: job.yaml\ngrid:\n  train.batch_size: [0, 2]\n")
    assert_one_line_error(segctl("validate", bad), f"{bad}:4: grid.train.batch_size[0]:")
