"""Where a training step's time goes, part by part, against what each part's work should cost.

For the V4 3-layer (ratios 0 / 4 / 128) and the V4.1 5-layer (0 / 2 / 2 / 1 / 1) models of
``nemo_dsa.integrations.side_by_side`` (the plugin and the built-in from one config, same
weights, as ``benchmarks/model_step.py`` builds them), at S tokens (default 16,384, bf16, CUDA):

1. the whole step on both sides: median of CUDA-event timings (``model_step.time_steps``),
   tokens/s, peak GiB;
2. the plugin's step under torch.profiler, every op's own device time given to one part:
   attention kernels, attention projections and glue, indexer, compressors, the V4.1
   quantise-dequantise chains (``nemo_dsa.ops.quant``), RoPE and norms, the hyper-connections
   (mixes, Sinkhorn, collapse / expand), MoE, LM head, embedding, loss, optimizer, other;
3. each part's work from the shapes of one step: FLOPs, bytes, and the time its bound allows.

How an op finds its part. Forward: profiler ranges opened around the parts' modules (forward
hooks) and around the functions the nemo_dsa layers call (RoPE, norms, quantisers, the attention
op), the innermost range naming the part; decoder-block code outside every such range is the
hyper-connections' collapse / expand (nemo-automodel writes them inline in the V4 block).
Backward: an autograd node runs under ``autograd::engine::evaluate_function`` with the sequence
number of the forward op that made it, so the backward goes to that op's part. Top-level ops:
the loss (``cross_entropy``), the optimizer's ranges; the rest is "other".

Work per part, for one step (forward + backward):
- matmuls: 2 x rows x weight size per call of a module with a 2-D weight (``nn.Linear``, the
  grouped ``wo_a``, the MoE gate, the LM head), the routed experts 2 x tokens x top-k x (gate-up
  + down) sizes; x3 where the call's output needs a gradient (dX and dW), x1 otherwise;
- attention op: 4 D FLOP per visible (query, head, key) forward, 10 D backward (S recomputed,
  dP, dQ, dK, dV); visible keys counted from the call's window and indices (or ks / ke);
- indexer scoring: 2 H D FLOP per visible (query, key) pair (from the call's ks / ke), forward
  only (the V4.1 indexer is frozen; V4's gets no gradient without the KL loss);
- bytes: every part call's tensor inputs and outputs once (the traffic of one fused pass), x2.5
  where the output needs a gradient (the backward reads the input and the output's gradient and
  writes the input's); loss: fp32 logits cast, log-softmax and its backward, 6 passes over
  S x vocab fp32; optimizer: fused AdamW reads and writes parameter, moments, reads the gradient.
- bound: max(FLOPs / peak FLOP/s, bytes / peak bytes/s). Peaks (``--peak-tflops``,
  ``--peak-tbs`` override): ~770 TFLOP/s bf16 dense (a bf16 8192-cubed matmul measured at
  766-790 on the H200, docs/performance.md; H100 SXM and H200 share the GH100 chip, 989 TFLOP/s
  dense on NVIDIA's data sheets); HBM 4.8 TB/s on the H200, 3.35 TB/s on the H100 SXM
  (NVIDIA's H200 and H100 data sheets).

Prints a markdown table per family and writes JSON (``--out``). ``--device cpu --tiny`` runs the
same instruments on CPU at toy widths (fp32, the tests' tiny configuration), self CPU time in
place of device time, for tests/integrations/test_step_profile.py.

    python benchmarks/step_profile.py --family v4 v41 --seq 16384 --out step_profile.json
    python benchmarks/step_profile.py --device cpu --tiny --family v41 --out /tmp/profile.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import math
import os
import statistics
import sys
import time

import torch
from torch.autograd.profiler import record_function

from nemo_dsa.integrations.side_by_side import (
    DEFAULT_RATIOS,
    TINY_OVERRIDES,
    TINY_SEQ,
    TINY_VOCAB,
    build,
    copy_weights,
    model_config,
    training_step,
)

PARTS = (
    "attention kernels", "attention projections & glue", "indexer", "compressors", "quant-dequant (ops/quant)",
    "RoPE & norms", "hyper-connections", "MoE", "LM head", "embedding", "loss", "optimizer", "other",
)  # fmt: skip
MARK = "part: "
BACKWARD = "autograd::engine::evaluate_function"
# Peak rates by card (see the module docstring for the sources).
PEAK_TFLOPS = 770.0
PEAK_TBS = {"H200": 4.8, "H100": 3.35}


# ----------------------------------------------------------------------------------------------
# Work of one step, from the shapes of its calls
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Work:
    flops: float = 0.0
    bytes: float = 0.0


def tensors_in(value):
    """Every tensor inside ``value`` (tensors, sequences, dicts, dataclasses)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from tensors_in(getattr(value, field.name))


def io_bytes(inputs, output) -> int:
    seen, total = set(), 0
    for t in (*tensors_in(inputs), *tensors_in(output)):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def needs_grad(output) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors_in(output))


def visible_pairs(ks, ke) -> int:
    return int((ke.long() - ks.long()).clamp_min(0).sum())


def attention_flops(args, kwargs, output) -> float:
    """The attention op's FLOPs: 4 D (forward) + 10 D (backward, when trained) per visible key."""
    q, raw_kv, window_start, window = args[:4]
    batch, seq, heads, dim = q.shape
    rows = torch.arange(seq, device=q.device) + raw_kv.shape[1] - seq
    first = torch.maximum(window_start.long(), rows - window + 1)
    keys = int((rows - first + 1).clamp_min(0).sum())
    if kwargs.get("indices") is not None:
        keys += int((kwargs["indices"] >= 0).sum())
    elif kwargs.get("ranges") is not None:
        keys += visible_pairs(kwargs["ranges"].ks, kwargs["ranges"].ke)
    return (4 + (10 if needs_grad(output) else 0)) * dim * heads * keys


def scoring_flops(args, kwargs, output) -> float:
    """Index scoring: 2 H D per visible (query, key) pair of the call's ranges (or ks / ke)."""
    q = args[0]
    ranges = kwargs.get("ranges", args[3])
    if hasattr(ranges, "ks"):  # a KeyRanges: the *_in_ranges entries the layers call
        ks, ke = ranges.ks, ranges.ke
    else:
        ks = kwargs["ks"] if "ks" in kwargs else args[3]
        ke = kwargs["ke"] if "ke" in kwargs else args[4]
    return 2.0 * q.shape[2] * q.shape[3] * visible_pairs(ks, ke)


# Functions the nemo_dsa layers call (looked up as module globals), wrapped in a part's range.
FUNCTIONS = {
    "nemo_dsa.layers.sparse_attention": {
        "apply_rope": "RoPE & norms", "rope_angles": "RoPE & norms", "rms_normalize": "RoPE & norms",
        "head_rms_rope": "RoPE & norms", "fp8_quant_dequant": "quant-dequant (ops/quant)",
        "nvfp4_quant_dequant": "quant-dequant (ops/quant)", "attend": "attention kernels",
        "attend_to_indices": "attention kernels",
    },
    "nemo_dsa.layers.compressor": {"apply_rope": "RoPE & norms", "rope_angles": "RoPE & norms"},
    "nemo_dsa.layers.indexer": {
        "apply_rope": "RoPE & norms", "rope_angles": "RoPE & norms", "mxfp4_quant_dequant": "quant-dequant (ops/quant)",
        "v4_indexer_in_ranges": "indexer", "v4_logits_in_ranges": "indexer", "indexer_scores_in_ranges": "indexer",
        "candidate_blocks_in_ranges": "indexer", "v4_select_full_precision": "indexer",
        "v41_scores_full_precision": "indexer",
    },
    "nemo_dsa.ops.fused_selection.interface": {"v41_select_topk_in_ranges": "indexer"},
}  # fmt: skip
# Methods the layers call on a part's module instead of its forward.
METHODS = {"hyper-connections": ("collapse", "expand"), "compressors": ("latent", "rotate"), "indexer": ("index_keys",)}
FLOPS_OF = {"attend": attention_flops, "v4_indexer_in_ranges": scoring_flops, "v4_logits_in_ranges": scoring_flops,
            "indexer_scores_in_ranges": scoring_flops, "v4_select_full_precision": scoring_flops,
            "v41_scores_full_precision": scoring_flops, "v41_select_topk_in_ranges": scoring_flops}  # fmt: skip


def module_part(name: str, module: torch.nn.Module) -> str | None:
    """The part a module's forward belongs to (None: not marked, its parent's part applies)."""
    cls = type(module).__name__
    leaf = name.rsplit(".", 1)[-1]
    parent = name.rsplit(".", 1)[0] if "." in name else ""
    if name == "model.embed_tokens":
        return "embedding"
    if name == "lm_head":
        return "LM head"
    if parent == "model.layers":
        return "hyper-connections"  # the block's own code: collapse / expand of the streams
    if "HyperConnection" in cls or "HyperHead" in cls:
        return "hyper-connections"
    if "RMSNorm" in cls or "Rotary" in cls:
        return "RoPE & norms"
    if parent.startswith("model.layers.") and parent.count(".") == 2:
        if leaf in ("self_attn", "attn"):
            return "attention projections & glue"
        if leaf in ("mlp", "ffn"):
            return "MoE"
    if cls == "Compressor":  # nemo_dsa.layers' modules
        return "compressors"
    if cls == "Indexer":
        return "indexer"
    return None


def all_modules(model):
    """(name, module) of every module once, the plugin's attention cores included (a
    ``CoreAttention`` registers the core's submodules but not the core itself)."""
    seen, stack = set(), [("", model)]
    while stack:
        prefix, root = stack.pop()
        for name, module in root.named_modules(prefix=prefix):
            if id(module) in seen:
                continue
            seen.add(id(module))
            yield name, module
            core = getattr(module, "_core", None)
            if isinstance(core, torch.nn.Module):
                stack.append((f"{name}.core", core))


class StepInstruments:
    """Profiler ranges around a model's parts; with ``count_work`` also the step's work per part.

    ``with StepInstruments(model) as marks:`` runs steps with the ranges on; ``marks.work`` holds
    what the steps run while ``count_work`` was True did (it reads tensor values: keep it off
    while profiling)."""

    def __init__(self, model: torch.nn.Module, top_k: int):
        self.model, self.top_k = model, top_k
        self.count_work = False
        self.work = {part: Work() for part in PARTS}
        self.stack: list[str] = []
        self._undo: list = []

    # -- bookkeeping of one marked call
    def _enter(self, part: str):
        self.stack.append(part)
        rf = record_function(MARK + part)
        rf.__enter__()
        return rf

    def _leave(self, rf, part, inputs, output, flops=0.0):
        rf.__exit__(None, None, None)
        self.stack.pop()
        if self.count_work:
            trained = needs_grad(output)
            self.work[part].bytes += io_bytes(inputs, output) * (2.5 if trained else 1.0)
            self.work[part].flops += flops

    def _matmul(self, module, inputs, output):
        if not self.count_work or not self.stack:
            return
        x = inputs[0]
        factor = 3 if needs_grad(output) else 1
        if hasattr(module, "gate_and_up_projs"):  # routed experts: top-k of them per token
            tokens = x.numel() // x.shape[-1] * self.top_k
            size = module.gate_and_up_projs[0].numel() + module.down_projs[0].numel()
        else:
            tokens, size = x.numel() // x.shape[-1], module.weight.numel()
        self.work[self.stack[-1]].flops += 2.0 * tokens * size * factor

    # -- installing and removing the instruments
    def __enter__(self):
        for name, module in all_modules(self.model):
            weight = getattr(module, "weight", None)
            if hasattr(module, "gate_and_up_projs") or (isinstance(weight, torch.Tensor) and weight.ndim == 2
                                                        and not isinstance(module, torch.nn.Embedding)):  # fmt: skip
                # Before the part's own hooks: its forward hook runs while the part is still open.
                self._undo.append(module.register_forward_hook(self._matmul).remove)
            part = module_part(name, module)
            if part is not None:
                self._mark_module(module, part)
                for method in METHODS.get(part, ()):  # parts the layers call by method, not forward
                    if callable(getattr(module, method, None)):
                        self._wrap(module, method, part, instance=True)
        for module_name, names in FUNCTIONS.items():
            owner = sys.modules.get(module_name) or __import__(module_name, fromlist=["_"])
            for fn_name, part in names.items():
                if hasattr(owner, fn_name):
                    self._wrap(owner, fn_name, part)
        return self

    def __exit__(self, *exc):
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def _mark_module(self, module, part):
        def pre(_module, args, kwargs):
            _module._step_profile_range = (self._enter(part), (args, kwargs))

        def post(_module, _args, _kwargs, output):
            rf, inputs = _module._step_profile_range
            del _module._step_profile_range
            self._leave(rf, part, inputs, output)

        self._undo.append(module.register_forward_pre_hook(pre, with_kwargs=True).remove)
        self._undo.append(module.register_forward_hook(post, with_kwargs=True).remove)

    def _wrap(self, owner, name, part, instance=False):
        original = getattr(owner, name)
        flops_of = FLOPS_OF.get(name)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            rf = self._enter(part)
            output = original(*args, **kwargs)
            flops = flops_of(args, kwargs, output) if (self.count_work and flops_of) else 0.0
            self._leave(rf, part, (args, kwargs), output, flops)
            return output

        setattr(owner, name, wrapper)
        if instance:
            self._undo.append(lambda: owner.__dict__.pop(name, None))
        else:
            self._undo.append(lambda: setattr(owner, name, original))


def fixed_work(model, seq: int, vocab: int) -> dict[str, Work]:
    """The loss's and the optimizer's work (no module runs them)."""
    logits = seq * vocab
    loss = Work(flops=0.0, bytes=logits * 2 + 6 * logits * 4)
    params = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return {"loss": loss, "optimizer": Work(bytes=7 * params)}


# ----------------------------------------------------------------------------------------------
# The profile, part by part
# ----------------------------------------------------------------------------------------------


def own_time_us(event, device: str) -> float:
    if device == "cuda":
        return float(getattr(event, "self_device_time_total", 0.0) or 0.0)
    return float(event.self_cpu_time_total)


def is_cpu_event(event) -> bool:
    return str(getattr(event, "device_type", "CPU")).endswith("CPU")


def ancestors(event):
    while event is not None:
        yield event
        event = event.cpu_parent


def forward_part(event) -> str | None:
    """The part of a forward op: its innermost part range, else a top-level rule."""
    for e in ancestors(event):
        if e.name.startswith(MARK):
            return e.name[len(MARK) :]
        if "cross_entropy" in e.name or "nll_loss" in e.name or "log_softmax" in e.name:
            return "loss"
        if e.name.startswith("Optimizer."):
            return "optimizer"
    return None


def parts_of(events, device: str) -> tuple[dict[str, float], float]:
    """(microseconds per part, total microseconds) of the profiled events."""
    by_sequence: dict[int, tuple[float, str]] = {}
    backward: dict[int, object] = {}
    for e in events:
        if e.name.startswith(BACKWARD):
            continue
        inside_backward = any(a.name.startswith(BACKWARD) for a in ancestors(e.cpu_parent))
        if not inside_backward and getattr(e, "sequence_nr", -1) >= 0:
            part = forward_part(e) or "other"
            start = e.time_range.start
            # The op that made a node is the last to start with its number (others only peeked at it).
            if e.sequence_nr not in by_sequence or start >= by_sequence[e.sequence_nr][0]:
                by_sequence[e.sequence_nr] = (start, part)
    times = {part: 0.0 for part in PARTS}
    total = 0.0
    for e in events:
        if not is_cpu_event(e):  # a kernel's own event: its time is in the op that launched it
            continue
        us = own_time_us(e, device)
        if not us:
            continue
        total += us
        part = None
        for a in ancestors(e):
            if a.name.startswith(BACKWARD):
                seq_nr = getattr(a, "sequence_nr", -1)
                part = by_sequence.get(seq_nr, (0, None))[1]
                break
        if part is None:
            part = forward_part(e) or "other"
        times[part] += us
    return times, total


def profile_parts(model, seq: int, vocab: int, steps: int, device: str, top_k: int) -> dict:
    """Counts one step's work, then profiles ``steps`` steps: per-part work and time."""
    from torch.profiler import ProfilerActivity, profile

    step, optimizer = training_step(model, seq, vocab, seed=1, device=device)
    with StepInstruments(model, top_k) as marks:
        marks.count_work = True
        step()
        marks.count_work = False
        step()
        sync(device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(steps):
                step()
            sync(device)
    del optimizer
    events = list(prof.events())
    times, total = parts_of(events, device)
    if device == "cuda":  # every kernel the profiler saw, whether or not an op launched it (a gap: unlinked kernels)
        total_check = sum(e.time_range.end - e.time_range.start for e in events if not is_cpu_event(e))
    else:  # top-level events' inclusive time, per thread
        total_check = sum(e.cpu_time_total for e in events if e.cpu_parent is None and is_cpu_event(e))
    work = marks.work
    work.update(fixed_work(model, seq, vocab))
    return {
        "steps": steps,
        "part_ms": {p: times[p] / 1000 / steps for p in PARTS},
        "total_ms": total / 1000 / steps,
        "profiled_total_ms": total_check / 1000 / steps,
        "work": {p: dataclasses.asdict(work[p]) for p in PARTS},
    }


# ----------------------------------------------------------------------------------------------
# Timing, the table, the command line
# ----------------------------------------------------------------------------------------------


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(model, seq: int, vocab: int, steps: int, warmup: int, device: str) -> dict:
    if device == "cuda":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from model_step import time_steps as cuda_time_steps

        return cuda_time_steps(model, seq, vocab, steps, warmup)
    step, _optimizer = training_step(model, seq, vocab, seed=0, device=device)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = step()
        times.append((time.perf_counter() - start) * 1000)
    ms = statistics.median(times)
    return {"ms": ms, "tokens_per_s": seq / (ms / 1000), "peak_gib": None, "last_loss": float(loss)}


def peaks(device: str, tflops: float | None, tbs: float | None) -> tuple[float | None, float | None, str]:
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    if tbs is None:
        tbs = next((v for card, v in PEAK_TBS.items() if card in name), None)
    if tflops is None and device == "cuda":
        tflops = PEAK_TFLOPS
    return tflops, tbs, name


def rows_of(profile: dict, tflops: float | None, tbs: float | None) -> list[dict]:
    rows = []
    for part in PARTS:
        ms, work = profile["part_ms"][part], profile["work"][part]
        row = {"part": part, "ms": ms, "flops": work["flops"], "bytes": work["bytes"]}
        row["tflops_per_s"] = work["flops"] / ms / 1e9 if ms else None
        row["tb_per_s"] = work["bytes"] / ms / 1e9 if ms else None
        compute_ms = work["flops"] / (tflops * 1e9) if tflops else None
        memory_ms = work["bytes"] / (tbs * 1e9) if tbs else None
        if compute_ms is not None and memory_ms is not None:
            row["bound"] = "compute" if compute_ms >= memory_ms else "memory"
            row["bound_ms"] = max(compute_ms, memory_ms)
        else:
            row["bound"], row["bound_ms"] = None, None
        rows.append(row)
    return rows


def table(family: str, seq: int, sides: dict, profile: dict, rows: list[dict], card: str) -> str:
    def num(value, fmt):
        return "-" if value is None else format(value, fmt)

    lines = [f"### {family}, S = {seq:,}, {card}", ""]
    for side, r in sides.items():
        if r.get("oom"):
            lines.append(f"- {side}: out of memory")
        else:
            lines.append(f"- {side}: {r['ms']:.1f} ms, {r['tokens_per_s']:,.0f} tokens/s, peak {num(r['peak_gib'], '.1f')} GiB")
    if all(s in sides and not sides[s].get("oom") for s in ("plugin", "builtin")):
        lines.append(f"- plugin / built-in tokens/s: {sides['plugin']['tokens_per_s'] / sides['builtin']['tokens_per_s']:.2f}x")
    if profile is None:
        return "\n".join(lines + ["", "Plugin profile: out of memory"])
    lines += ["", f"Plugin, per step ({profile['steps']} profiled): parts sum {profile['total_ms']:.1f} ms, "
              f"profiled total {profile['profiled_total_ms']:.1f} ms", "",
              "| part | ms | % | GFLOP | GB | TFLOP/s | TB/s | bound | bound ms | ms / bound ms |",
              "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    total = profile["total_ms"] or 1.0
    for r in rows:
        ratio = r["ms"] / r["bound_ms"] if r["bound_ms"] else None
        lines.append(
            f"| {r['part']} | {r['ms']:.2f} | {100 * r['ms'] / total:.1f} | {r['flops'] / 1e9:,.1f} | {r['bytes'] / 1e9:,.2f} "
            f"| {num(r['tflops_per_s'], '.1f')} | {num(r['tb_per_s'], '.2f')} | {r['bound'] or '-'} "
            f"| {num(r['bound_ms'], '.2f')} | {num(ratio, '.1f')} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", nargs="+", default=["v4", "v41"], choices=["v4", "v41"])
    parser.add_argument("--seq", type=int, default=None, help="tokens a step (default 16,384; --tiny: the tests')")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="toy widths, fp32 (the tests' configuration)")
    parser.add_argument("--sides", nargs="+", default=["plugin", "builtin"], choices=["plugin", "builtin"],
                        help="sides timed; the plugin is also profiled")  # fmt: skip
    parser.add_argument("--vocab", type=int, default=None, help="default 32,768 (--tiny: 64)")
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--profile-steps", type=int, default=2)
    parser.add_argument("--peak-tflops", type=float, default=None, help="compute peak (default 770 on CUDA)")
    parser.add_argument("--peak-tbs", type=float, default=None, help="HBM peak TB/s (default by card name)")
    parser.add_argument("--out", default=None, help="JSON file (the table goes next to it as .md)")
    parser.add_argument("--hc-backend", default=None, choices=["auto", "triton", "torch"],
                        help="the plugin's hyper_connection_backend (default: the plugin's default)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.exit(2, "step_profile: --device cuda needs a CUDA GPU (or --device cpu --tiny)\n")
    if args.device == "cpu" and not args.tiny:
        parser.exit(2, "step_profile: --device cpu runs only the --tiny configuration\n")
    vocab = args.vocab or (TINY_VOCAB if args.tiny else 32768)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    tflops, tbs, card = peaks(args.device, args.peak_tflops, args.peak_tbs)
    results, tables = [], []
    for family in args.family:
        seq = args.seq or (TINY_SEQ[family] if args.tiny else 16384)
        overrides = TINY_OVERRIDES[family] if args.tiny else {}
        config = model_config(family, DEFAULT_RATIOS[family], vocab, args.experts,
                              dtype="float32" if args.tiny else "bfloat16", **overrides)  # fmt: skip
        if args.hc_backend:
            config.hyper_connection_backend = args.hc_backend  # read by the plugin's constructor only
        build_kwargs = {"device": args.device, "dtype": dtype, "attn": "sdpa" if args.device == "cpu" else "tilelang"}
        torch.manual_seed(0)
        sides, weights, profile = {}, None, None
        for side in ["plugin"] + [s for s in args.sides if s != "plugin"]:
            model = build(side, config, weights, **build_kwargs)
            if weights is None:
                weights = copy_weights(model)
            top_k = getattr(config, "text_config", config).num_experts_per_tok
            try:
                if side in args.sides:
                    sides[side] = time_steps(model, seq, vocab, args.steps, args.warmup, args.device)
                    print(f"{family} S={seq} {side}: {sides[side]}", flush=True)
                if side == "plugin":
                    profile = profile_parts(model, seq, vocab, args.profile_steps, args.device, top_k)
            except torch.OutOfMemoryError:  # the other side and family still run
                sides.setdefault(side, {"oom": True})
                print(f"{family} S={seq} {side}: out of memory", flush=True)
            del model
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
        rows = rows_of(profile, tflops, tbs) if profile else []
        tables.append(table(family, seq, sides, profile, rows, card))
        print("\n" + tables[-1] + "\n", flush=True)
        results.append({"family": family, "S": seq, "card": card, "peak_tflops": tflops, "peak_tbs": tbs,
                        "sides": sides, "profile": profile, "parts": rows})  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"results": results}, f, indent=1)
        with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
            f.write("\n\n".join(tables) + "\n")


if __name__ == "__main__":
    main()
