"""Measure one GPU through PyTorch: the numbers the machine model's constants and step times are held against.

Run on the machine whose profile it measures (one GPU is enough; nothing here needs a second one)::

    python3 benchmarks/gpu_measure.py --out DIR          # writes DIR/gpu_measure.json, section by section

What it times (CUDA events; every figure is the median of timed runs after warm-up runs):

* ``gemm``: bf16 products ``(M x K) @ (K x N)`` as ``nn.Linear`` runs its three passes (forward
  ``X W^T``, input gradient ``dY W``, weight gradient ``dY^T X``), for the layers of GPT-3 175B and
  Llama 3 8B/70B at tensor-parallel splits 1-8, and a sweep of N at fixed M, K (wave quantisation);
* ``attention``: ``scaled_dot_product_attention`` (causal, head dim 128, bf16), forward and forward +
  backward, with the backend PyTorch picks (FlashAttention on Hopper);
* ``memory_bound``: ``x * 2``, GeLU, LayerNorm, RMSNorm-as-written, softmax on (T, d) bf16 tensors: bytes
  read and written per second;
* ``host``: pinned host <-> device copies by size;
* ``fp8``: ``torch._scaled_mm`` (E4M3 x E4M3 -> bf16) against the bf16 product of the same shape;
* ``steps``: whole training steps of Hugging Face GPT-2 and Llama models built from their configs (random
  weights, bf16 parameters, fused AdamW): forward + backward and the optimizer step timed apart, peak
  memory, and the CUDA kernels of one step by kind (torch.profiler);
* ``compiled_steps`` (not in the default list): the same steps of GPT-2 124M and Llama 3.2 1B under
  ``torch.compile`` (the warm-up steps compile);
* ``jax_steps`` (not in the default list: run it in a process of its own): flax.linen language models
  (``gpu_jax_models.py``), forward + backward as XLA compiles it, and XLA's memory analysis.

``--smoke`` runs every section at toy sizes (on CPU too) so that the script is tested where no GPU is.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

GPT3 = (12288, 4 * 12288)  # d_model, d_ff of GPT-3 175B (Brown et al. 2020, Table 2.1)
LLAMA8 = (4096, 14336, 1024)  # d_model, d_ff, kv width (8 kv heads x 128) of Llama 3 8B (Llama 3 paper, Table 3)
LLAMA70 = (8192, 28672, 1024)


def timer(device: torch.device, reps: int, warmup: int) -> Callable[[Callable[[], Any]], float]:
    """The median seconds of ``reps`` calls after ``warmup`` calls (CUDA events on a GPU, else wall time)."""
    def run(fn: Callable[[], Any]) -> float:
        for _ in range(warmup):
            fn()
        times = []
        if device.type == "cuda":
            torch.cuda.synchronize()
            for _ in range(reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
        else:
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)
    return run


def linear_passes(tokens: int, n: int, k: int, dt: torch.dtype, dev: torch.device,
                  time_it: Callable[[Callable[[], Any]], float]) -> dict[str, Any]:
    """The three products of ``nn.Linear(k, n)`` on ``tokens`` rows: Y = X W^T, dX = dY W, dW = dY^T X."""
    x = torch.randn(tokens, k, dtype=dt, device=dev)
    w = torch.randn(n, k, dtype=dt, device=dev)
    dy = torch.randn(tokens, n, dtype=dt, device=dev)
    row = {"tokens": tokens, "n": n, "k": k}
    row["forward_s"] = time_it(lambda: x @ w.t())  # (tokens x k) @ (k x n)
    row["input_grad_s"] = time_it(lambda: dy @ w)  # (tokens x n) @ (n x k)
    row["weight_grad_s"] = time_it(lambda: dy.t() @ x)  # (n x tokens) @ (tokens x k)
    flops = 2.0 * tokens * n * k
    for p in ("forward", "input_grad", "weight_grad"):
        row[f"{p}_tflops"] = flops / row[f"{p}_s"] / 1e12
    return row


def gemm_section(smoke: bool, dt: torch.dtype, dev: torch.device, time_it: Callable) -> dict[str, Any]:
    rows = []
    if smoke:
        layers = [("toy", 64, 128, 96)]
        sweep: list[tuple[int, int, int]] = [(128, n, 64) for n in (64, 96, 128)]
    else:
        layers = []
        for tp in (1, 2, 4, 8):
            d, f = GPT3
            layers += [(f"gpt3 qkv tp{tp}", 8192, 3 * d // tp, d), (f"gpt3 proj tp{tp}", 8192, d, d // tp),
                       (f"gpt3 fc1 tp{tp}", 8192, f // tp, d), (f"gpt3 fc2 tp{tp}", 8192, d, f // tp)]
        for name, (d, f, kv) in (("llama3-8b", LLAMA8), ("llama3-70b", LLAMA70)):
            for tp in (1, 8):
                layers += [(f"{name} qkv tp{tp}", 8192, (d + 2 * kv) // tp, d),
                           (f"{name} o tp{tp}", 8192, d, d // tp),
                           (f"{name} gate_up tp{tp}", 8192, 2 * f // tp, d),
                           (f"{name} down tp{tp}", 8192, d, f // tp)]
        layers += [("gpt2 lm_head vocab 50257", 16384, 50257, 768), ("gpt2 lm_head vocab 50304", 16384, 50304, 768),
                   ("llama3.2-1b lm_head", 8192, 128256, 2048), ("llama3-8b lm_head", 8192, 128256, 4096)]
        layers += [("square 8192", 8192, 8192, 8192), ("square 4096", 4096, 4096, 4096),
                   ("square 2048", 2048, 2048, 2048), ("square 1024", 1024, 1024, 1024)]
        sweep = [(8192, n, 4096) for n in range(256, 8193, 256)]
    for name, t, n, k in layers:
        rows.append({"layer": name, **linear_passes(t, n, k, dt, dev, time_it)})
    sweep_rows = []
    for m, n, k in sweep:
        a = torch.randn(m, k, dtype=dt, device=dev)
        b = torch.randn(k, n, dtype=dt, device=dev)
        s = time_it(lambda: a @ b)
        sweep_rows.append({"m": m, "n": n, "k": k, "seconds": s, "tflops": 2.0 * m * n * k / s / 1e12})
    return {"layers": rows, "n_sweep": sweep_rows}


def attention_section(smoke: bool, dt: torch.dtype, dev: torch.device, time_it: Callable) -> list[dict[str, Any]]:
    import torch.nn.functional as F

    shapes = [(1, 2, 2, 64, 32)] if smoke else [
        (b, h, kv, s, 128) for (b, s) in ((8, 1024), (4, 2048), (2, 4096), (1, 8192)) for (h, kv) in ((32, 32), (32, 8))]
    shapes += [] if smoke else [(1, 96, 96, 2048, 128), (1, 12, 12, 2048, 128)]  # GPT-3 175B heads, 1 and 8-way TP
    rows = []
    for b, h, kv, s, d in shapes:
        q = torch.randn(b, h, s, d, dtype=dt, device=dev, requires_grad=True)
        k = torch.randn(b, kv, s, d, dtype=dt, device=dev, requires_grad=True)
        v = torch.randn(b, kv, s, d, dtype=dt, device=dev, requires_grad=True)
        g = torch.randn(b, h, s, d, dtype=dt, device=dev)
        kw = {"is_causal": True, "enable_gqa": h != kv}

        def fwd() -> Any:
            with torch.no_grad():
                return F.scaled_dot_product_attention(q, k, v, **kw)

        def fwd_bwd() -> None:
            o = F.scaled_dot_product_attention(q, k, v, **kw)
            torch.autograd.grad(o, (q, k, v), g)
        tf, tb = time_it(fwd), time_it(fwd_bwd)
        # causal attention: 2 products of 2 b h s^2 d FLOPs each, half of the scores kept
        flops = 2 * 2.0 * b * h * s * s * d / 2
        rows.append({"batch": b, "heads": h, "kv_heads": kv, "seq": s, "head_dim": d, "causal": True,
                     "forward_s": tf, "forward_backward_s": tb, "forward_tflops": flops / tf / 1e12,
                     "forward_backward_tflops": 3.5 * flops / tb / 1e12})
    return rows


def memory_bound_section(smoke: bool, dt: torch.dtype, dev: torch.device, time_it: Callable) -> list[dict[str, Any]]:
    import torch.nn.functional as F

    t, d = (256, 64) if smoke else (8192, 12288)
    x = torch.randn(t, d, dtype=dt, device=dev)
    w = torch.ones(d, dtype=dt, device=dev)
    b = torch.zeros(d, dtype=dt, device=dev)
    y = torch.randn(t, d, dtype=dt, device=dev)
    n = x.numel() * x.element_size()

    def rms() -> Any:  # as Llama's RMSNorm is written: fp32 variance, rsqrt, two multiplies
        h = x.float()
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dt)
    cases = [("x * 2", lambda: x * 2, 2), ("x + y", lambda: x + y, 3), ("gelu (tanh)", lambda: F.gelu(x, approximate="tanh"), 2),
             ("layer_norm", lambda: F.layer_norm(x, (d,), w, b), 2), ("rms_norm as Llama writes it", rms, 2),
             ("softmax", lambda: torch.softmax(x, -1), 2)]
    cases.append(("x.float() (bf16 read, fp32 written)", lambda: x.float(), 3))
    rows = []
    for name, fn, tensors in cases:
        s = time_it(fn)
        rows.append({"op": name, "shape": [t, d], "seconds": s, "bytes_moved": tensors * n,
                     "bytes_per_second": tensors * n / s})
    # the loss as Hugging Face computes it: bf16 logits upcast to fp32, cross entropy, its backward
    tv, vocab = (64, 512) if smoke else (8192, 128256)
    logits = torch.randn(tv, vocab, dtype=dt, device=dev, requires_grad=True)
    labels = torch.randint(0, vocab, (tv,), device=dev)

    def ce() -> None:
        loss = F.cross_entropy(logits.float(), labels)
        torch.autograd.grad(loss, logits)
    s = time_it(ce)
    rows.append({"op": "cross_entropy(logits.float()) forward + backward", "shape": [tv, vocab], "seconds": s,
                 "bytes_moved": None, "bytes_per_second": None})
    return rows


def host_section(smoke: bool, dev: torch.device, time_it: Callable) -> list[dict[str, Any]]:
    if dev.type != "cuda":
        return []
    rows = []
    for mib in ((1,) if smoke else (0.0625, 1, 16, 256, 1024)):
        nbytes = int(mib * 2**20)
        h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        g = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        up = time_it(lambda: g.copy_(h, non_blocking=True))
        down = time_it(lambda: h.copy_(g, non_blocking=True))
        rows.append({"bytes": nbytes, "host_to_device_s": up, "device_to_host_s": down,
                     "host_to_device_bytes_per_second": nbytes / up, "device_to_host_bytes_per_second": nbytes / down})
    return rows


def fp8_section(smoke: bool, dev: torch.device, time_it: Callable) -> list[dict[str, Any]]:
    if dev.type != "cuda" or not hasattr(torch, "float8_e4m3fn"):
        return []
    rows = []
    for m, n, k in ((8192, 8192, 8192), (8192, 12288, 12288), (8192, 49152, 12288), (8192, 4096, 4096)):
        a = torch.randn(m, k, device=dev).to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device=dev).to(torch.float8_e4m3fn)
        one = torch.ones((), device=dev)
        s8 = time_it(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
        a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
        s16 = time_it(lambda: a16 @ b16.t())
        f = 2.0 * m * n * k
        rows.append({"m": m, "n": n, "k": k, "fp8_s": s8, "bf16_s": s16, "fp8_tflops": f / s8 / 1e12,
                     "bf16_tflops": f / s16 / 1e12})
    return rows


STEP_MODELS = {  # name: (family, config keywords, batch, sequence)
    "gpt2-124m": ("gpt2", {"n_layer": 12, "n_embd": 768, "n_head": 12}, 16, 1024),
    "gpt2-355m": ("gpt2", {"n_layer": 24, "n_embd": 1024, "n_head": 16}, 8, 1024),
    "gpt2-774m": ("gpt2", {"n_layer": 36, "n_embd": 1280, "n_head": 20}, 8, 1024),
    "gpt2-1.5b": ("gpt2", {"n_layer": 48, "n_embd": 1600, "n_head": 25}, 4, 1024),
    "llama3.2-1b": ("llama", {"num_hidden_layers": 16, "hidden_size": 2048, "intermediate_size": 8192,
                              "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                              "tie_word_embeddings": True}, 4, 2048),
    "llama3-8b-8layers": ("llama", {"num_hidden_layers": 8, "hidden_size": 4096, "intermediate_size": 14336,
                                    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                                    "tie_word_embeddings": False}, 2, 4096),
}
SMOKE_MODELS = {
    "gpt2-toy": ("gpt2", {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 512}, 2, 64),
    "llama-toy": ("llama", {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}, 2, 64),
}


def build_model(family: str, cfg: dict[str, Any], seq: int) -> Any:
    """The Hugging Face causal LM of ``family`` from its config, SDPA attention, no dropout, no cache."""
    import transformers

    if family == "gpt2":
        c = transformers.GPT2Config(n_positions=max(1024, seq), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                    use_cache=False, attn_implementation="sdpa", **cfg)
        return transformers.GPT2LMHeadModel(c)
    c = transformers.LlamaConfig(max_position_embeddings=max(2048, seq), use_cache=False, attn_implementation="sdpa",
                                 **cfg)
    return transformers.LlamaForCausalLM(c)


def kernel_kinds(prof: Any) -> dict[str, Any]:
    """Seconds of the profiled CUDA kernels by kind (name patterns: products, attention, the rest), and the 25
    longest kernels with their calls."""
    out: dict[str, Any] = {"gemm": 0.0, "attention": 0.0, "optimizer": 0.0, "other": 0.0}
    top: list[tuple[float, str, int]] = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        if not t or getattr(ev, "device_type", None) is not None and "CUDA" not in str(ev.device_type):
            continue
        name = ev.key.lower()
        if "flash" in name or "fmha" in name or "attention" in name:  # before "cutlass": fmha_cutlass kernels
            kind = "attention"
        elif any(s in name for s in ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "ampere_", "cublas")):
            kind = "gemm"
        elif "adam" in name or "multi_tensor" in name:
            kind = "optimizer"
        else:
            kind = "other"
        out[kind] += t / 1e6
        top.append((t / 1e6, ev.key[:120], int(getattr(ev, "count", 0))))
    out["top_kernels"] = [{"seconds": t, "kernel": k, "calls": c} for t, k, c in sorted(top, reverse=True)[:25]]
    return out


COMPILED = ("gpt2-124m", "llama3.2-1b")  # the models also timed under torch.compile (section compiled_steps)


def steps_section(smoke: bool, dt: torch.dtype, dev: torch.device, reps: int,
                  compiled: bool = False) -> list[dict[str, Any]]:
    rows = []
    models = SMOKE_MODELS if smoke else STEP_MODELS
    for name, (family, cfg, batch, seq) in models.items():
        if compiled and not smoke and name not in COMPILED:
            continue
        row: dict[str, Any] = {"model": name, "family": family, "config": cfg, "batch": batch, "seq": seq,
                               "dtype": str(dt).removeprefix("torch."), "attention": "sdpa", "optimizer": "AdamW fused",
                               "torch_compile": compiled}
        try:
            with torch.device(dev):
                model = build_model(family, cfg, seq).to(dt)
            if compiled:
                model = torch.compile(model)
            row["attention_implementation"] = getattr(getattr(model, "config", None), "_attn_implementation", None)
            params = sum(p.numel() for p in model.parameters())
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=dev.type == "cuda")
            vocab = cfg.get("vocab_size", 50257)
            ids = torch.randint(0, vocab, (batch, seq), device=dev)

            def fwd_bwd() -> None:
                model(input_ids=ids, labels=ids).loss.backward()

            def step() -> None:
                opt.step()
                opt.zero_grad(set_to_none=False)
            for _ in range(3):
                fwd_bwd()
                step()
            t_fb, t_opt = [], []
            sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            for _ in range(reps):
                sync()
                t0 = time.perf_counter()
                fwd_bwd()
                sync()
                t1 = time.perf_counter()
                step()
                sync()
                t_fb.append(t1 - t0)
                t_opt.append(time.perf_counter() - t1)
            row.update({"params": params, "forward_backward_s": statistics.median(t_fb),
                        "optimizer_s": statistics.median(t_opt), "forward_backward_all_s": t_fb,
                        "tokens_per_second": batch * seq / (statistics.median(t_fb) + statistics.median(t_opt))})
            if dev.type == "cuda":
                row["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
                row["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
                try:
                    from torch.profiler import ProfilerActivity, profile
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        fwd_bwd()
                        step()
                        sync()
                    row["kernels_s"] = kernel_kinds(prof)
                except Exception as exc:  # the profiler is an extra: its failure must not lose the step times
                    row["kernels_error"] = repr(exc)[:300]
        except Exception as exc:
            row["error"] = repr(exc)[:500]
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        rows.append(row)
        print(f"step {name}: {row.get('forward_backward_s')} s fwd+bwd, {row.get('optimizer_s')} s opt", flush=True)
        print("row " + json.dumps(row), flush=True)
    return rows


def jax_steps_section(smoke: bool, reps: int, out: Path | None = None) -> list[dict[str, Any]]:
    """The flax models of ``gpu_jax_models.py``: ``jax.jit(jax.value_and_grad(loss))`` (forward + backward, no
    optimizer) on JAX's first device, median seconds of ``reps`` after 3 warm-up steps, XLA's memory analysis
    and cost analysis (its FLOPs and "bytes accessed" of the optimised program) of the compiled step, and, given
    ``out``, the optimised HLO text in ``out/hlo_<model>.txt`` (the fusions XLA chose for this device). Run it in
    its own process (``--sections jax_steps``): JAX and PyTorch each hold GPU memory."""
    import jax

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_jax_models import JAX_MODELS, SMOKE_MODELS, build

    rows = []
    for name in (SMOKE_MODELS if smoke else JAX_MODELS):
        row: dict[str, Any] = {"model": name, "shape": list((SMOKE_MODELS if smoke else JAX_MODELS)[name]),
                               "jax": jax.__version__, "device": str(jax.devices()[0].device_kind)}
        try:
            loss_fn, params, batch = build(name, smoke)
            step = jax.jit(jax.value_and_grad(loss_fn))
            compiled = step.lower(params, batch).compile()
            mem = compiled.memory_analysis()
            if mem is not None:
                row["xla_memory"] = {k: int(getattr(mem, k)) for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                                                       "temp_size_in_bytes", "alias_size_in_bytes")
                                     if hasattr(mem, k)}
            row["xla_cost"] = xla_cost(compiled)
            if out is not None:
                (out / f"hlo_{name}.txt").write_text(compiled.as_text())
            for _ in range(3):
                jax.block_until_ready(compiled(params, batch))
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                jax.block_until_ready(compiled(params, batch))
                times.append(time.perf_counter() - t0)
            row.update({"params": int(sum(x.size for x in jax.tree.leaves(params))),
                        "forward_backward_s": statistics.median(times), "forward_backward_all_s": times})
        except Exception as exc:
            row["error"] = repr(exc)[:500]
        rows.append(row)
        print(f"jax step {name}: {row.get('forward_backward_s')} s", flush=True)
        print("row " + json.dumps(row), flush=True)  # kept in the log should a later model exceed a time limit
    return rows


def xla_cost(compiled: Any) -> dict[str, float]:
    """The totals of XLA's cost analysis of a compiled program ("flops", "transcendentals", "bytes accessed" and
    its per-operand split): one dict, or the first of the list older JAX versions return; {} when the backend
    gives none."""
    try:
        cost = compiled.cost_analysis()
    except Exception:  # some backends raise instead of returning None
        return {}
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return {str(k): float(v) for k, v in (cost or {}).items()
            if isinstance(v, (int, float)) and not str(k).startswith("utilization")}


def describe(dev: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
                            "python": platform.python_version(), "platform": platform.platform()}
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        info.update({"device": p.name, "sm_count": p.multi_processor_count, "memory_bytes": p.total_memory,
                     "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()})
        try:
            q = "name,driver_version,clocks.max.sm,clocks.max.mem,power.limit,memory.total"
            info["nvidia_smi"] = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
                                                capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError) as exc:
            info["nvidia_smi"] = repr(exc)
    else:
        info["device"] = "cpu"
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for gpu_measure.json")
    ap.add_argument("--smoke", action="store_true", help="toy sizes, any device")
    ap.add_argument("--sections", default="gemm,attention,memory_bound,host,fp8,steps")
    args = ap.parse_args(argv)
    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dt = torch.bfloat16
    reps, warm = (3, 1) if args.smoke else (20, 5)
    time_it = timer(dev, reps, warm)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"benchmark": "gpu_measure", "machine": describe(dev),
                              "timing": f"median of {reps} runs after {warm} warm-up runs, CUDA events"}
    path = out / "gpu_measure.json"
    for section in args.sections.split(","):
        t0 = time.perf_counter()
        try:
            if section == "gemm":
                result[section] = gemm_section(args.smoke, dt, dev, time_it)
            elif section == "attention":
                result[section] = attention_section(args.smoke, dt, dev, time_it)
            elif section == "memory_bound":
                result[section] = memory_bound_section(args.smoke, dt, dev, time_it)
            elif section == "host":
                result[section] = host_section(args.smoke, dev, time_it)
            elif section == "fp8":
                result[section] = fp8_section(args.smoke, dev, time_it)
            elif section == "compiled_steps":
                result[section] = steps_section(args.smoke, dt, dev, 3 if args.smoke else 10, compiled=True)
            elif section == "jax_steps":
                result[section] = jax_steps_section(args.smoke, 3 if args.smoke else 10, out)
            elif section == "steps":
                result[section] = steps_section(args.smoke, dt, dev, 3 if args.smoke else 10)
            else:
                raise SystemExit(f"gpu_measure: unknown section {section!r}")
        except Exception as exc:  # keep the other sections' numbers
            result[section] = {"error": repr(exc)[:500]}
        result.setdefault("section_seconds", {})[section] = time.perf_counter() - t0
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"{section}: {time.perf_counter() - t0:.1f} s", flush=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
