"""A simulated fleet for measuring the head at scale: the real head actor (its
Controller, state.db, stores, ingest) over many simulated nodes whose agents live
in a few Ray actors.

The seam is the one the real head has (`Head.controller`): a node list and, per
node, an agent handle. `SimHead` gives Ray's node table's place to a fixed list of
`sim` nodes and each node an agent handle whose `run`, `ping`, `cancel` and `probe`
are remote calls to a `SimHost` actor hosting many agents. Everything else is the
real head: placement, the state machine, ingest, sealing, adapters.

A simulated attempt answers like node/attempt.py's `run_attempt`: it reports its
start (`head.started`), sends the engine's events (schemas/events.py: start; per
step a `step` and a `phase` event; `eval` every eval_every; `checkpoint` events
followed by the checkpoint's files as the engine writes them; `end`) in batches of
FLUSH_ROWS or every `flush_s` (the head's pace), then the `adapter` event, and returns an
AttemptResult with the adapter (and the best eval's) as safetensors bytes shaped
for the job's model and LoRA. Only the engine is fake: its steps take `step_s`
each and its numbers are made up.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import random
import time
from pathlib import Path

import numpy as np
import ray

from segctl.node.attempt import FLUSH_ROWS
from segctl.orchestrator.actor import Head
from segctl.orchestrator.head import Controller
from segctl.schemas import events as ev
from segctl.schemas.records import AttemptResult, AttemptSpec, NodeInfo

CHIP = "sim"
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def sim_nodes(n: int, memory_gb: float = 8.0, max_trials: int = 1) -> list[NodeInfo]:
    return [NodeInfo(name=f"sim{i:04d}", chip=CHIP, memory_gb=memory_gb, os="linux",
                     max_trials=max_trials) for i in range(n)]


# ------------------------------------------------------------------ the head

class SimHead(Head):
    """The real head actor; only its fleet is simulated. `fleet`: nodes, memory_gb,
    max_trials, hosts (SimHost actors to spread the agents over), step_s."""

    def __init__(self, root: str, fleet: dict):
        self.fleet = fleet
        self.sampler = Sampler() if fleet.get("profile") else None
        super().__init__(root)

    def profile(self, top: int = 40) -> dict:
        """Where the head's threads were (sampled stacks) and the CPU seconds of its
        methods (thread time, each method's own calls included in its caller's)."""
        out = self.sampler.top(top) if self.sampler else {}
        out["cpu"] = {k: [round(v[0], 2), v[1]] for k, v in getattr(self, "cpu", {}).items()}
        import resource
        ru = resource.getrusage(resource.RUSAGE_SELF)
        out["process_cpu_s"] = round(ru.ru_utime + ru.ru_stime, 1)
        return out

    def controller(self, root: Path) -> Controller:
        me = ray.get_runtime_context().current_actor
        f = self.fleet
        nodes = sim_nodes(f["nodes"], f.get("memory_gb", 8.0), f.get("max_trials", 1))
        hosts = [ray.remote(SimHost).options(num_cpus=0, max_concurrency=100_000).remote(
            me, f["step_s"])
                 for i in range(max(1, min(f.get("hosts", 4), len(nodes))))]
        index = {n.name: i for i, n in enumerate(nodes)}
        c = Controller(root, list_nodes=lambda: list(nodes),
                       spawn_agent=lambda name: SimAgent(hosts[index[name] % len(hosts)], name))
        if f.get("profile"):   # CPU seconds of the calling thread per method, and calls
            self.cpu = {}
            for name in ("turn", "place", "finish", "_seal", "dispatch", "ingest", "started",
                         "checkpoint", "judge"):
                setattr(c, name, _timed(getattr(c, name), name, self.cpu))
        return c


def _timed(fn, name: str, into: dict):
    def timed(*args, **kw):
        t = time.thread_time()
        try:
            return fn(*args, **kw)
        finally:
            acc = into.setdefault(name, [0.0, 0])
            acc[0] += time.thread_time() - t
            acc[1] += 1
    return timed


class Sampler:
    """A sampling profiler of every thread of this process (the controller loop and
    Ray's request threads alike): every `every` s, each thread's stack is counted,
    per function (inclusive) and per leaf."""

    def __init__(self, every: float = 0.005):
        import sys
        import threading
        from collections import Counter
        self.incl, self.leaf, self.samples = Counter(), Counter(), 0
        me = None

        def loop():
            nonlocal me
            me = threading.get_ident()
            while True:
                time.sleep(every)
                for tid, frame in sys._current_frames().items():
                    if tid == me:
                        continue
                    seen, leaf = set(), True
                    busy = frame.f_code.co_name not in ("wait", "select", "_wait_once",
                                                         "main_loop", "sleep")
                    if not busy:
                        continue
                    self.samples += 1
                    while frame is not None:
                        key = f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}"
                        if leaf:
                            self.leaf[key] += 1
                            leaf = False
                        if key not in seen:
                            self.incl[key] += 1
                            seen.add(key)
                        frame = frame.f_back
        threading.Thread(target=loop, daemon=True, name="sampler").start()

    def top(self, n: int) -> dict:
        s = max(1, self.samples)
        return {"samples": self.samples,
                "inclusive": [(round(c / s, 3), k) for k, c in self.incl.most_common(n)],
                "leaf": [(round(c / s, 3), k) for k, c in self.leaf.most_common(n)]}


class _Call:
    """`agent.run.remote(spec)` as the head writes it, sent to the host with the node's name."""

    def __init__(self, method, name: str):
        self.method, self.name = method, name

    def remote(self, *args):
        return self.method.remote(self.name, *args)


class SimAgent:
    """What the head holds for one simulated node: node/agent.py's NodeAgent interface."""

    def __init__(self, host, name: str):
        self.name = name
        for call in ("run", "ping", "cancel", "probe"):
            setattr(self, call, _Call(getattr(host, call), name))


# ------------------------------------------------------------------ the agents

class SimHost:
    """Many simulated node agents in one async actor: each attempt is a coroutine."""

    def __init__(self, head, step_s: float):
        self.head, self.step_s = head, step_s
        self.cancelled: set[int] = set()
        self.running: dict[str, set] = {}

    async def ping(self, name: str) -> dict:
        return {"name": name, "host": f"simhost-{os.getpid()}", "pid": os.getpid(),
                "running": sorted(map(str, self.running.get(name, ())))}

    async def cancel(self, name: str, attempt) -> bool:
        if attempt in self.running.get(name, ()):
            self.cancelled.add(attempt)
            return True
        return False

    async def probe(self, name: str, tune: str, spec) -> dict:
        return {"error": "simulated nodes do not probe"}

    @ray.method(num_returns=2)
    async def run(self, name: str, spec: AttemptSpec) -> tuple[float | None, AttemptResult]:
        self.running.setdefault(name, set()).add(spec.attempt)
        try:
            result = await self._run(spec)
            return result.ended, result
        finally:
            self.running[name].discard(spec.attempt)
            self.cancelled.discard(spec.attempt)

    async def _run(self, spec: AttemptSpec) -> AttemptResult:
        job, aid, head = spec.job.model_dump(mode="json"), spec.attempt, self.head
        train = job["train"]
        total = int(train["iters"])
        eval_every = int(train.get("eval_every") or 0) if job["data"].get("valid") else 0
        ckpt_every = int(train.get("checkpoint_every") or 0)
        seg = int(job["memory"]["segment_size"]) or 1
        engine = FakeEngine(job, aid, seg)
        first = (spec.checkpoint_step or 0) + 1
        head.started.remote(aid, os.getpid(), time.time())   # as the real agent: not awaited

        seq, batch = 0, []
        best = (None, math.inf)

        def add(event: dict) -> None:
            nonlocal seq
            event["seq"] = seq
            seq += 1
            batch.append(event)

        async def flush() -> None:
            nonlocal batch
            if batch:
                out, batch = batch, []
                await head.ingest.remote(aid, out)

        add(engine.start(total, spec.checkpoint_step))
        t0, last_flush, step = time.monotonic(), time.monotonic(), first - 1
        while step < total and aid not in self.cancelled:
            # the engine runs at its pace; the agent forwards every spec.flush_s or FLUSH_ROWS
            per_flush = max(1, min(int(spec.flush_s / self.step_s), FLUSH_ROWS // 2))
            wake = t0 + (step - first + 1 + per_flush) * self.step_s
            await asyncio.sleep(max(0.0, min(wake, last_flush + spec.flush_s) - time.monotonic()))
            due = min(total, first - 1 + int((time.monotonic() - t0) / self.step_s))
            while step < due:
                step += 1
                add(engine.step(step))
                add(engine.phase(step))
                if eval_every and step % eval_every == 0:
                    e = engine.eval(step)
                    add(e)
                    if e["val_loss"] < best[1]:
                        best = (step, e["val_loss"])
                if ckpt_every and step % ckpt_every == 0 and step < total:
                    add({"event": "checkpoint", "time": time.time(), "step": step,
                         "path": f"out/checkpoints/step-{step:07d}"})
                    await flush()   # telemetry up to the checkpoint first, as the real agent
                    await head.checkpoint.remote(aid, step, engine.checkpoint(step, best[0]))
                    last_flush = time.monotonic()
            if len(batch) >= FLUSH_ROWS or time.monotonic() - last_flush >= spec.flush_s:
                await flush()
                last_flush = time.monotonic()
        ended = time.time()
        if aid in self.cancelled:
            await flush()
            return AttemptResult(attempt=aid, outcome="cancelled", message="cancelled",
                                 exit_code=-15, steps=step, ended=ended, peak_gb=engine.peak)
        add(engine.end(step, best))
        await flush()
        adapter = engine.adapter(step)
        best_files = engine.best_adapter(best[0]) if best[0] else {}
        digest = lambda files: {n: hashlib.sha256(b).hexdigest() for n, b in files.items()}
        await head.ingest.remote(aid, [{"event": "adapter", "seq": seq, "time": time.time(),
                                        "sha256": digest(adapter),
                                        **({"best_sha256": digest(best_files)} if best_files else {})}])
        return AttemptResult(attempt=aid, outcome="succeeded", exit_code=ev.EXIT_OK,
                             peak_gb=engine.peak, steps=step, ended=ended,
                             final_loss=engine.loss(step), val_loss=engine.last_val,
                             adapter=adapter, best_adapter=best_files,
                             best_step=best[0], best_val_loss=None if best[0] is None else best[1])


# ------------------------------------------------------------------ the engine

class FakeEngine:
    """The events and files the engine would produce for one attempt, with made-up
    numbers: the shapes, names and schemas are the real ones."""

    def __init__(self, job: dict, attempt: int, segment_size: int):
        self.job, self.attempt = job, attempt
        self.rng = random.Random(attempt)
        self.peak = 0.02 + 0.01 * self.rng.random()
        self.last_val = None
        self.scale = 0.5 + self.rng.random()
        self.shape = model_shape(job.get("model"))
        self.layers = self.shape["num_hidden_layers"]
        self.segments = max(1, math.ceil(self.layers / segment_size))
        self.labels = ([f"fwd{k}" for k in range(self.segments)] + ["head"]
                       + [f"bwd{k}" for k in reversed(range(self.segments))] + ["update"])
        self._adapter_cache: dict | None = None

    def loss(self, step: int) -> float:
        return 2.0 + self.scale * 4.0 / math.sqrt(step)

    def start(self, total: int, resumed_from) -> dict:
        return _checked(ev.Start(time=time.time(), job=self.job.get("name", "sim"),
                                 mode="segmented", segment_size=int(self.job["memory"]["segment_size"]),
                                 total_steps=total, resumed_from=resumed_from, train_rows=60,
                                 valid_rows=8, truncated=0, skipped=0, trainable_params=110_592))

    def step(self, step: int) -> dict:
        # built as a dict with exactly Step's fields (validated once, in `_TEMPLATES`)
        return {"time": time.time(), "event": "step", "step": step, "loss": self.loss(step),
                "tokens": 240, "seconds": 0.01, "tokens_per_s": 24_000.0,
                "lr": 2e-4, "grad_norm": 0.5 + self.rng.random(), "peak_gb": self.peak,
                "active_gb": self.peak * 0.6, "cache_gb": self.peak * 0.1, "margin": None,
                "accuracy": None, "prefix_shared": None, "chosen_reward": None,
                "rejected_reward": None, "rows": 1, "sequences": 1, "seq_tokens": 256,
                "pack_efficiency": None, "rank": None, "rank_rows": None, "allreduce_s": None,
                "allreduce_bytes": None}

    def phase(self, step: int) -> dict:
        return {"time": time.time(), "event": "phase", "step": step,
                "phases": [[label, self.peak * (0.5 + 0.5 * i / len(self.labels))]
                           for i, label in enumerate(self.labels)]}

    def eval(self, step: int) -> dict:
        self.last_val = self.loss(step) + 0.1 * self.rng.random()
        return _checked(ev.Eval(time=time.time(), step=step, val_loss=self.last_val,
                                val_tokens=1600, seconds=0.05))

    def end(self, step: int, best) -> dict:
        return _checked(ev.End(time=time.time(), step=step, adapter="out/adapters.safetensors",
                               final_loss=self.loss(step), val_loss=self.last_val, seconds=1.0,
                               best_adapter="out/best_adapters.safetensors" if best[0] else None,
                               best_step=best[0], best_val_loss=best[1] if best[0] else None))

    def _tensors(self) -> dict[str, np.ndarray]:
        """LoRA A and B of every linear of every layer, float32, at the job's rank."""
        if self._adapter_cache is None:
            rank = int(self.job["lora"]["rank"])
            n_layers = int(self.job["lora"].get("num_layers", -1))
            n_layers = self.layers if n_layers < 0 else min(n_layers, self.layers)
            c = self.shape
            hidden, inter = c["hidden_size"], c["intermediate_size"]
            heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
            hd = c.get("head_dim") or hidden // heads
            dims = {"self_attn.q_proj": (hidden, heads * hd), "self_attn.k_proj": (hidden, kv * hd),
                    "self_attn.v_proj": (hidden, kv * hd), "self_attn.o_proj": (heads * hd, hidden),
                    "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter),
                    "mlp.down_proj": (inter, hidden)}
            rng = np.random.default_rng(self.attempt)
            out = {}
            for layer in range(self.layers - n_layers, self.layers):
                for key in LINEARS:
                    i, o = dims[key]
                    name = f"model.layers.{layer}.{key}"
                    out[f"{name}.lora_a"] = rng.standard_normal((i, rank), dtype=np.float32)
                    out[f"{name}.lora_b"] = rng.standard_normal((rank, o), dtype=np.float32)
            self._adapter_cache = out
        return self._adapter_cache

    def _config(self) -> bytes:
        lora = self.job["lora"]
        return json.dumps({"fine_tune_type": "lora", "num_layers": lora.get("num_layers", -1),
                           "lora_parameters": {"rank": lora["rank"], "scale": lora["scale"],
                                               "dropout": lora.get("dropout", 0.0)}}).encode()

    def adapter(self, step: int) -> dict[str, bytes]:
        t = {k: v * (1 + step * 1e-3) for k, v in self._tensors().items()}
        return {"adapters.safetensors": safetensors(t), "adapter_config.json": self._config()}

    def best_adapter(self, step: int) -> dict[str, bytes]:
        return self.adapter(step)

    def checkpoint(self, step: int, best_step) -> dict[str, bytes]:
        """What engine/train.py's save_checkpoint writes: the adapter, the optimizer
        state (AdamW's two moments per tensor and its step), the config, the run's
        position, and the best eval's adapter once there is one."""
        tensors = self._tensors()
        opt = {f"{n}.{m}": v * 0.01 for n, v in tensors.items() for m in ("m", "v")}
        opt["step"] = np.array([step], dtype=np.float32)
        files = {"adapters.safetensors": self.adapter(step)["adapters.safetensors"],
                 "optimizer.safetensors": safetensors(opt),
                 "adapter_config.json": self._config(),
                 "state.json": json.dumps({"step": step, "data_position": step,
                                           "rows_per_step": 1, "seed": 0,
                                           "best_step": best_step}).encode()}
        if best_step:
            files["best_adapters.safetensors"] = self.adapter(best_step)["adapters.safetensors"]
        return files


# The demo model's shape (`segctl init-demo`), for a job whose model folder is not here.
DEMO_SHAPE = {"num_hidden_layers": 4, "hidden_size": 128, "intermediate_size": 384,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}


def model_shape(folder) -> dict:
    try:
        return {**DEMO_SHAPE, **json.loads((Path(folder) / "config.json").read_text())}
    except (OSError, TypeError, ValueError):
        return dict(DEMO_SHAPE)


def safetensors(tensors: dict[str, np.ndarray]) -> bytes:
    header, offset, blobs = {}, 0, []
    for name, a in tensors.items():
        raw = np.ascontiguousarray(a, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + b"".join(blobs)


def _checked(event: ev.Event) -> dict:
    return json.loads(event.model_dump_json())


# Step and Phase events are built as plain dicts for speed: hold them to the schema.
_probe = FakeEngine({"memory": {"segment_size": 1}, "lora": {"rank": 8, "scale": 20.0}}, 0, 1)
ev.Step.model_validate(_probe.step(1))
ev.Phase.model_validate(_probe.phase(1))
assert set(_probe.step(1)) == set(ev.Step.model_fields) | {"event"}
del _probe
