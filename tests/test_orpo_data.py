"""ORPO inputs: preference rows -> token ids (every bad row a `file:line` error),
and the job / sweep / telemetry vocabulary that carries ORPO settings and figures."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from segctl.engine.data import DataError, Example, PreferenceExample, load_dataset, load_preferences
from segctl.engine.demo import _render_chat, demo_examples, write_model
from segctl.schemas import SpecError
from segctl.schemas.events import Step
from segctl.schemas.job import JobSpec, load_job
from segctl.schemas.sweep import job_keys, load_sweep


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A one-layer demo model (ChatML template) with a small train file next to it."""
    root = tmp_path_factory.mktemp("orpo")
    corpus = [_render_chat(r["prompt"], r["completion"]) for r in demo_examples(200, 0)]
    write_model(root / "model", "qwen3", corpus=corpus, layers=1, hidden=32)
    (root / "train.jsonl").write_text(
        json.dumps({"prompt": "after q", "chosen": "r s t", "rejected": "x y"}) + "\n")
    return root / "model"


def tokenizer_of(folder: Path):
    from mlx_lm.utils import load_tokenizer
    eos = json.loads((folder / "config.json").read_text())["eos_token_id"]
    return load_tokenizer(folder, eos_token_ids=eos)


@pytest.fixture(scope="module")
def tok(model_dir):
    return tokenizer_of(model_dir)


def jsonl(tmp_path: Path, *rows, name="pairs.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return p


def chat(tok, messages, **kw) -> list[int]:
    return list(tok.apply_chat_template(messages, return_dict=False, **kw))


PAIR = {"prompt": "after q", "chosen": "r s t u v", "rejected": "x y"}


# ------------------------------------------------------------------ rows


def test_string_prompt_is_the_generation_prompt_and_responses_follow_it(tok, tmp_path):
    ds = load_dataset(jsonl(tmp_path, PAIR), tok, method="orpo")
    (ex,) = ds.examples
    assert isinstance(ex, PreferenceExample) and (ds.truncated, ds.skipped) == (0, 0)
    user = [{"role": "user", "content": "after q"}]
    assert ex.prompt == chat(tok, user, add_generation_prompt=True)
    assert ex.prompt + ex.chosen == chat(tok, user + [{"role": "assistant", "content": "r s t u v"}])
    assert ex.prompt + ex.rejected == chat(tok, user + [{"role": "assistant", "content": "x y"}])
    assert tok.decode(ex.chosen) == "r s t u v<|im_end|>\n"
    assert tok.decode(ex.rejected) == "x y<|im_end|>\n"


def test_message_prompts_system_key_and_response_shapes(tok, tmp_path):
    convo = [{"role": "user", "content": "after q"}, {"role": "assistant", "content": "r s t u v"}]
    rows = [
        PAIR,
        {"prompt": [{"role": "user", "content": "after q"}], "chosen": convo,
         "rejected": {"content": "x y"}},
        {"question": "after q", "chosen": {"messages": convo}, "rejected": [convo[1] | {"content": "x y"}]},
        {**PAIR, "system": "be brief"},
        {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "after q"}],
         "chosen": "r s t u v", "rejected": "x y", "id": 7, "preference_score": 1.0},
    ]
    a, b, c, d, e = load_dataset(jsonl(tmp_path, *rows), tok, method="orpo").examples
    assert a == b == c and d == e
    assert d.chosen == a.chosen and d.rejected == a.rejected
    system = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "after q"}]
    assert d.prompt == chat(tok, system, add_generation_prompt=True) != a.prompt


def test_truncation_cuts_each_response_tail_and_counts_rows(tok, tmp_path):
    short = {"prompt": "after q", "chosen": "r", "rejected": "x"}
    path = jsonl(tmp_path, short, PAIR, PAIR)
    full = load_dataset(path, tok, method="orpo").examples[1]
    limit = len(full.prompt) + len(full.rejected)  # room for the rejected response, not the chosen
    assert len(full.chosen) > len(full.rejected)
    ds = load_dataset(path, tok, method="orpo", max_seq_length=limit)
    assert (ds.truncated, ds.skipped, len(ds)) == (2, 0, 3)
    cut = ds.examples[1]
    assert cut.prompt == full.prompt and cut.rejected == full.rejected
    assert cut.chosen == full.chosen[:len(full.rejected)]
    assert all(len(ex.prompt) + len(r) <= limit for ex in ds.examples for r in (ex.chosen, ex.rejected))

    ds = load_dataset(path, tok, method="orpo", max_seq_length=limit, overlong="skip")
    assert (ds.truncated, ds.skipped, len(ds)) == (0, 2, 1)
    with pytest.raises(DataError, match=r"pairs\.jsonl: no usable rows"):
        load_preferences(jsonl(tmp_path, PAIR), tok, max_seq_length=limit, overlong="skip")


def test_a_prompt_filling_max_seq_length_is_a_row_error_not_a_nan(tok, tmp_path):
    path = jsonl(tmp_path, PAIR, {**PAIR, "prompt": "after " + "q " * 60})
    with pytest.raises(DataError, match=r"pairs\.jsonl:2: the prompt alone is \d+ tokens; "
                                        r"max_seq_length 40 leaves no response"):
        load_dataset(path, tok, method="orpo", max_seq_length=40)
    # with skip the row is just too long
    ds = load_dataset(path, tok, method="orpo", max_seq_length=40, overlong="skip")
    assert (len(ds), ds.skipped) == (1, 1)


MSG = {"role": "user", "content": "hi"}


@pytest.mark.parametrize("row, fragment", [
    ('{"prompt": "after q", ', "not valid JSON"),
    ("[1, 2]", "row must be a JSON object, got list"),
    ({"prompt": "a", "chosen": "b"}, "missing 'rejected' (keys: chosen, prompt)"),
    ({"prompt": "a", "completion": "b"}, "missing 'chosen', 'rejected'"),
    ({"chosen": "b", "rejected": "c"}, "missing 'prompt'"),
    ({**PAIR, "prompt": ""}, "'prompt' is empty"),
    ({**PAIR, "prompt": 3}, "'prompt' must be a non-empty string or a non-empty list of messages"),
    ({**PAIR, "prompt": []}, "'prompt' must be a non-empty string or a non-empty list"),
    ({**PAIR, "prompt": [{"role": "user"}]}, "prompt[0] needs string 'role' and 'content'"),
    ({**PAIR, "prompt": [MSG, {"role": "assistant", "content": "x"}]},
     "'prompt' must not end with the assistant's message"),
    ({**PAIR, "chosen": ""}, "'chosen' is empty"),
    ({**PAIR, "rejected": ""}, "'rejected' is empty"),
    ({**PAIR, "chosen": None}, "'chosen' must be a string or a list of messages, got NoneType"),
    ({**PAIR, "rejected": 5}, "'rejected' must be a string or a list of messages, got int"),
    ({**PAIR, "chosen": []}, "'chosen' is an empty list"),
    ({**PAIR, "chosen": [MSG]}, "'chosen' must end with the assistant's message, got 'user'"),
    ({**PAIR, "rejected": [MSG, {"role": "assistant", "content": 1}]},
     "rejected[1] needs string 'role' and 'content'"),
    ({**PAIR, "rejected": {"text": "x"}}, "'rejected' as an object needs a string 'content'"),
    ({**PAIR, "system": ""}, "'system' must be a non-empty string"),
    ({**PAIR, "system": "s", "prompt": [{"role": "system", "content": "t"}, MSG]},
     "both 'system' and a system message in 'prompt'"),
    ({**PAIR, "preference_score": 0.5}, "'preference_score' is not supported"),
])
def test_every_bad_row_is_an_error_at_its_line(tok, tmp_path, row, fragment):
    path = jsonl(tmp_path, PAIR, "", row)  # a blank line still counts as a line
    with pytest.raises(DataError) as e:
        load_dataset(path, tok, method="orpo")
    assert str(e.value).startswith(f"{path}:3: "), str(e.value)
    assert fragment in str(e.value)


def test_missing_file_and_empty_file(tok, tmp_path):
    with pytest.raises(DataError, match=r"nope\.jsonl: data file not found"):
        load_dataset(tmp_path / "nope.jsonl", tok, method="orpo")
    with pytest.raises(DataError, match=r"pairs\.jsonl: no usable rows"):
        load_dataset(jsonl(tmp_path, ""), tok, method="orpo")


def with_template(model_dir: Path, tmp_path: Path, template: str):
    """The tokenizer of a copy of the demo model whose chat template is `template`."""
    folder = tmp_path / "model"
    shutil.copytree(model_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return tokenizer_of(folder)


def test_a_template_that_does_not_render_the_prompt_as_a_prefix_is_refused(model_dir, tmp_path):
    # the finished turn says "assistant:" where the generation prompt says "assistant\n"
    tok2 = with_template(model_dir, tmp_path, (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + ':' + m['content'] + '<|im_end|>' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"))
    with pytest.raises(DataError, match=r"pairs\.jsonl:1: chat template does not render the prompt "
                                        r"as a prefix"):
        load_dataset(jsonl(tmp_path, PAIR), tok2, method="orpo")


def test_a_prompt_merged_into_a_response_gives_that_branch_its_own_prompt(model_dir, tmp_path):
    # A generation prompt ending in a space: byte-level BPE merges it with a response
    # that starts with a letter (" r") but not with one it never saw (" ~"), so the
    # two branches' prompts differ by a token and the row is marked for two branches.
    tok2 = with_template(model_dir, tmp_path, (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '<|im_end|>' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"))
    row = {"prompt": "after q", "chosen": "r s t", "rejected": "~~ ~"}
    (ex,) = load_dataset(jsonl(tmp_path, row), tok2, method="orpo").examples
    prompt = chat(tok2, [{"role": "user", "content": "after q"}], add_generation_prompt=True)
    assert ex.rejected_prompt == prompt and ex.prompt == prompt[:-1]
    for branch_prompt, response, text in ((ex.prompt, ex.chosen, "r s t"),
                                          (ex.rejected_prompt, ex.rejected, "~~ ~")):
        whole = chat(tok2, [{"role": "user", "content": "after q"},
                            {"role": "assistant", "content": text}])
        assert branch_prompt + response == whole


def test_sft_rows_are_unchanged(tok, tmp_path):
    rows = [{"prompt": "after q", "completion": "r s t"}, {"text": "a b c"},
            {"messages": [MSG, {"role": "assistant", "content": "yo"}]}]
    path = jsonl(tmp_path, *rows, name="sft.jsonl")
    ds = load_dataset(path, tok)
    assert ds.examples == load_dataset(path, tok, method="sft").examples
    assert all(isinstance(ex, Example) for ex in ds.examples)
    convo = [{"role": "user", "content": "after q"}, {"role": "assistant", "content": "r s t"}]
    assert ds.examples[0] == Example(chat(tok, convo), len(chat(tok, convo[:1], add_generation_prompt=True)))
    assert ds.examples[1] == Example(list(tok.encode("a b c")) + [tok.eos_token_id], 0)
    # a preference file fed to sft fails the sft way, and vice versa
    with pytest.raises(DataError, match=r"pairs\.jsonl:1: 'completion' must be a string \(missing\)"):
        load_dataset(jsonl(tmp_path, PAIR), tok)
    with pytest.raises(DataError, match=r"sft\.jsonl:1: a preference row needs"):
        load_dataset(path, tok, method="orpo")


# ------------------------------------------------------------------ job


JOB = """\
model: model
method: orpo
data:
  train: train.jsonl
train:
  iters: 3
orpo:
  lambda: 0.25
  nll_scope: full
  prefix_shared: false
"""


def job_problems(tmp_path, text) -> list[str]:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as e:
        load_job(path)
    return e.value.problems


def test_orpo_job_reads_lambda_and_round_trips_through_its_dump(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(JOB)
    job = load_job(path)
    assert job.method == "orpo"
    assert (job.orpo.lambda_, job.orpo.nll_scope, job.orpo.prefix_shared) == (0.25, "full", False)
    dumped = job.model_dump(mode="json")
    assert dumped["orpo"] == {"lambda": 0.25, "nll_scope": "full", "prefix_shared": False}
    assert JobSpec.model_validate(dumped) == job  # the fleet's path: dump, store, validate
    assert JobSpec.model_validate(json.loads(job.model_dump_json())) == job
    assert JobSpec.model_validate(job.model_dump(by_alias=False)) == job  # by name works too
    # defaults
    plain = JobSpec.model_validate({"method": "orpo", "model": "m", "data": {"train": "t"},
                                    "train": {"iters": 1}})
    assert (plain.orpo.lambda_, plain.orpo.nll_scope, plain.orpo.prefix_shared) == (0.1, "response", True)


def test_sft_job_dump_has_no_orpo_section_and_round_trips(tmp_path):
    job = JobSpec.model_validate({"model": "m", "data": {"train": "t"}, "train": {"iters": 1}})
    assert job.method == "sft" and "orpo" not in job.model_dump() and "orpo" not in job.model_dump_json()
    assert JobSpec.model_validate(job.model_dump(mode="json")) == job


@pytest.mark.parametrize("old, new, line, message", [
    ("  lambda: 0.25", "  lamda: 0.25", 8, "orpo.lamda: unknown key; did you mean 'lambda'?"),
    ("  lambda: 0.25", "  lambda: -1", 8, "orpo.lambda: Input should be greater than or equal to 0"),
    ("  nll_scope: full", "  nll_scope: prompt", 9, "orpo.nll_scope: Input should be 'response' or 'full'"),
    ("method: orpo", "method: ppo", 2, "method: Input should be 'sft', 'orpo' or 'dpo'"),
    ("method: orpo", "method: sft", 7, "orpo: only used with method: orpo"),
])
def test_orpo_job_problems_point_at_their_line(tmp_path, old, new, line, message):
    assert job_problems(tmp_path, JOB.replace(old, new)) == [f"{tmp_path / 'job.yaml'}:{line}: {message}"]


# ------------------------------------------------------------------ sweep


def sweep_files(model_dir: Path, tmp_path: Path, grid: str, method="orpo") -> Path:
    (tmp_path / "job.yaml").write_text(
        JOB.replace("model: model", f"model: {model_dir}")
           .replace("train: train.jsonl", f"train: {model_dir.parent / 'train.jsonl'}")
           .replace("method: orpo", f"method: {method}"))
    path = tmp_path / "sweep.yaml"
    path.write_text(f"name: s\nbase: job.yaml\n{grid}")
    return path


def test_sweep_grid_and_random_over_orpo_lambda(model_dir, tmp_path):
    assert {"orpo.lambda", "orpo.nll_scope", "orpo.prefix_shared", "method"} <= set(job_keys())
    assert "orpo.lambda_" not in job_keys()
    path = sweep_files(model_dir, tmp_path, "grid:\n  orpo.lambda: [0.1, 0.2]\n"
                                            "random:\n  samples: 1\n  params:\n"
                                            "    train.learning_rate: {log_uniform: [1.0e-5, 1.0e-4]}\n")
    trials = load_sweep(path).trials
    assert [t.job.orpo.lambda_ for t in trials] == [0.1, 0.2]
    assert [t.params["orpo.lambda"] for t in trials] == [0.1, 0.2]
    assert all(t.job.orpo.nll_scope == "full" for t in trials)  # the rest of the base section stays
    for t in trials:
        assert JobSpec.model_validate(t.job.model_dump(mode="json")) == t.job

    path = sweep_files(model_dir, tmp_path, "random:\n  samples: 2\n  params:\n"
                                            "    orpo.lambda: {uniform: [0.0, 1.0]}\n")
    trials = load_sweep(path).trials
    assert [t.job.orpo.lambda_ for t in trials] == [t.params["orpo.lambda"] for t in trials]


def test_sweep_problems_with_orpo_keys(model_dir, tmp_path):
    path = sweep_files(model_dir, tmp_path, "grid:\n  orpo.lamda: [0.1]\n")
    with pytest.raises(SpecError) as e:
        load_sweep(path)
    assert e.value.problems == [f"{path}:4: grid.orpo.lamda: unknown job key; did you mean 'orpo.lambda'?"]

    path = sweep_files(model_dir, tmp_path, "grid:\n  orpo.lambda:\n    - 0.1\n    - -2\n")
    with pytest.raises(SpecError) as e:
        load_sweep(path)
    assert e.value.problems == [f"{path}:6: grid.orpo.lambda[1]: Input should be greater than or equal to 0"]


# ------------------------------------------------------------------ telemetry


def test_step_event_carries_orpo_figures_into_the_steps_table():
    from segctl.orchestrator.stores import attempt_tables

    figures = dict(time=1.0, step=1, loss=0.7, tokens=12, seconds=0.1, tokens_per_s=120.0, lr=1e-4,
                   grad_norm=0.5, peak_gb=1.0, active_gb=0.5, cache_gb=0.1)
    orpo = Step(**figures, margin=0.25, accuracy=1.0, prefix_shared=False)
    back = Step.model_validate_json(orpo.model_dump_json())
    assert back == orpo and (back.margin, back.accuracy, back.prefix_shared) == (0.25, 1.0, False)
    sft = Step(**figures)
    assert (sft.margin, sft.accuracy, sft.prefix_shared) == (None, None, None)
    assert Step.model_validate_json(sft.model_dump_json()) == sft

    events = [json.loads(orpo.model_dump_json()), json.loads(sft.model_dump_json())]
    steps = attempt_tables("t000", 1, events)["steps"].to_pydict()
    assert steps["margin"] == [0.25, None] and steps["accuracy"] == [1.0, None]
    assert steps["prefix_shared"] == [False, None]
