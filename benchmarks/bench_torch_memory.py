"""Activation memory of PyTorch training steps: what shardplan charges against what autograd keeps.

The models are ``benchmarks/gpu_measure.py``'s ``STEP_MODELS`` (Hugging Face GPT-2 124M to 1.5B, Llama 3.2
1B, Llama 3 8B cut to 8 layers; bf16 parameters, SDPA attention, ``model(input_ids=ids, labels=ids).loss``).

* ``small`` (CPU): each model at a small size (2 layers, widths / 16, vocabulary 1024, batch 2 x 64
  tokens, bf16). Measured: the bytes of the distinct storages autograd saves for the backward pass
  (``torch.autograd.graph.saved_tensors_hooks``, parameters left out), of the model run eagerly and of its
  exported program run node by node (:func:`shardplan.torch.saved.measure`, which also charges them to
  operators); predicted: ``sum(op.saved * |output| * element bytes)`` of the traced graph, and what the model
  charged before operators described what autograd keeps (one output per operator). And the step's peak on
  the CPU: the most bytes the allocator held at once during forward + backward (the profiler's allocation
  events; parameters, their zeroed gradients and the inputs allocated before it) against the saved bytes plus
  the largest transient of a backward step (:func:`shardplan.cost.memory.transient_bytes`: the tensors'
  :attr:`~shardplan.ir.Operator.transient` tiles).
* ``full`` (CPU, no GPU needed): each model at its measured size, built on the meta device and moved with
  ``to_empty`` (the tied head tied again), planned with ``shardplan.torch.plan(..., machine=preset("h100", 1),
  fit=False, stages=False)``; beside it, from a measurement JSON (``--measured``, ``gpu_measure.py``'s
  output, section ``steps``), the peak memory the H100 allocated in the step, and, from a device run of this
  script (``--device-measured``), the bytes held at the start of the backward pass, and so the transient the
  step's peak adds to it (peak - state - kept) against the predicted transient.
* ``--device-run PATH`` (on a GPU): per model, the memory allocated after one warm step (weights, gradients,
  AdamW state), the bytes the forward pass adds and keeps until the backward pass, the saved-tensor bytes
  counted by the hooks, and the peaks of the forward pass and of the whole step.

    PYTHONPATH=. python benchmarks/bench_torch_memory.py --measured benchmarks/results/gpu_measure_h100.json
    python benchmarks/bench_torch_memory.py --device-run OUT/torch_memory_device.json      # on the GPU

writes ``benchmarks/results/torch_memory.json``. The ``full`` rows need transformers 5 (the release the GPU
measurement ran: ``.venv-hf5``); the small rows run in either environment.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests"))

SMALL = {"layers": 2, "shrink": 16, "vocab": 1024, "batch": 2, "seq": 64}


def _loss_module(model: Any) -> Any:
    import torch

    class Loss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=ids, labels=ids).loss

    return Loss()


def _small_config(family: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The model's config at :data:`SMALL` size: 2 layers, every width divided by 16 (heads kept), small vocabulary."""
    k = SMALL["shrink"]
    if family == "gpt2":
        return {**cfg, "n_layer": SMALL["layers"], "n_embd": cfg["n_embd"] // k, "vocab_size": SMALL["vocab"]}
    return {**cfg, "num_hidden_layers": SMALL["layers"], "hidden_size": cfg["hidden_size"] // k,
            "intermediate_size": cfg["intermediate_size"] // k, "vocab_size": SMALL["vocab"]}


def by_kind(graph: Any, nbytes: int, measured: dict[str, float] | None = None) -> dict[str, dict[str, float]]:
    """Per operator kind: operators, bytes charged before (one output each), bytes charged now, and measured."""
    out: dict[str, dict[str, float]] = {}
    for op in graph:
        row = out.setdefault(op.kind, {"operators": 0, "one_output_bytes": 0.0, "predicted_bytes": 0.0})
        row["operators"] += 1
        row["one_output_bytes"] += math.prod(op.output.shape) * nbytes
        row["predicted_bytes"] += op.saved * math.prod(op.output.shape) * nbytes
        if measured is not None:
            row["measured_bytes"] = row.get("measured_bytes", 0.0) + measured.get(op.name, 0.0)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["one_output_bytes"]))


def eager_saved_bytes(module: Any, args: tuple) -> float:
    """Bytes autograd saves when ``module(*args)`` runs eagerly (:func:`shardplan.torch.saved.eager_saved_bytes`)."""
    from shardplan.torch.saved import eager_saved_bytes as measured

    return measured(module, args)


def graph_transient_bytes(graph: Any, nbytes: float) -> float:
    """The largest transient of a backward step of ``graph`` on one device (:attr:`Operator.transient` tiles, each in
    its tensor's element size: ``elem_factor`` elements of ``nbytes``)."""
    return max((sum(n * math.prod(t.shape) * t.elem_factor * nbytes
                    for n, t in zip(op.transient, (op.output, *op.inputs, *op.weights))) for op in graph), default=0.0)


def cpu_step_peak_bytes(module: Any, args: tuple) -> int:
    """The most bytes the CPU allocator holds at once during ``module(*args).backward()`` beyond what it held
    before (one warm step first; gradients zeroed in place, ``set_to_none=False``, as the GPU steps run)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for p in module.parameters():
        p.grad = torch.zeros_like(p)
    module(*args).backward()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        module(*args).backward()
    live = peak = 0
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def small_rows() -> list[dict[str, Any]]:
    import torch

    from benchmarks.gpu_measure import STEP_MODELS, build_model
    from shardplan.torch import saved as sv
    from shardplan.torch import trace

    rows = []
    for name, (family, cfg, _, _) in STEP_MODELS.items():
        torch.manual_seed(0)
        module = _loss_module(build_model(family, _small_config(family, cfg), SMALL["seq"]).to(torch.bfloat16))
        ids = torch.randint(0, SMALL["vocab"], (SMALL["batch"], SMALL["seq"]))
        t0 = time.process_time()
        graph, info = trace(module, (ids,))
        trace_cpu = time.process_time() - t0
        ref = sv.reference_bytes(module)
        elems = {op.name: math.prod(op.output.shape) for op in graph}
        m = sv.measure(info.program, module, (ids,), None, info.value_ops.get, elems, ref)
        pred = {op.name: op.saved * elems[op.name] * ref for op in graph}
        diffs: dict[str, dict[str, float]] = {}
        for op in graph:
            d = pred[op.name] - m.by_operator.get(op.name, 0.0)
            if abs(d) > 0.5:
                row = diffs.setdefault(op.kind, {"operators": 0, "predicted_minus_measured_bytes": 0.0})
                row["operators"] += 1
                row["predicted_minus_measured_bytes"] += d
        predicted = sum(pred.values())
        eager = eager_saved_bytes(module, (ids,))
        transient = graph_transient_bytes(graph, ref)
        cpu_peak = cpu_step_peak_bytes(module, (ids,))
        rows.append({
            "model": name, "size": "small", "config": _small_config(family, cfg), "batch": SMALL["batch"],
            "seq": SMALL["seq"], "dtype": "bfloat16", "operators": len(graph.operators),
            "eager_saved_bytes": eager,
            "cpu_step_peak_bytes": cpu_peak, "predicted_transient_bytes": transient,
            "predicted_step_peak_bytes": predicted + transient, "step_peak_ratio": (predicted + transient) / cpu_peak,
            "eager_saved_plus_transient_over_cpu_peak": (eager + transient) / cpu_peak,
            "program_saved_bytes": m.total_bytes, "predicted_bytes": predicted,
            "predicted_one_output_per_operator_bytes": sum(elems.values()) * ref,
            "ratio": predicted / m.total_bytes, "differences_by_kind": diffs,
            "by_kind": by_kind(graph, ref, dict(m.by_operator)), "trace_cpu_s": trace_cpu})
        print(f"small {name}: measured {m.total_bytes:.0f} B, predicted {predicted:.0f} B "
              f"({predicted / m.total_bytes:.3f}), one output per operator {sum(elems.values()) * ref:.0f} B; "
              f"CPU step peak {cpu_peak} B, saved + transient predicted {predicted + transient:.0f} B "
              f"({(predicted + transient) / cpu_peak:.3f})", flush=True)
    return rows


def full_rows(measured: dict[str, Any], device: dict[str, Any]) -> list[dict[str, Any]]:
    import torch

    import shardplan.torch as st
    from benchmarks.gpu_measure import STEP_MODELS, build_model
    from shardplan import preset

    gpu = {r["model"]: r for r in measured.get("steps", [])}
    dev = {r["model"]: r for r in device.get("rows", [])}
    rows = []
    for name, (family, cfg, batch, seq) in STEP_MODELS.items():
        with torch.device("meta"):
            model = build_model(family, cfg, seq).to(torch.bfloat16)
        model = model.to_empty(device="cpu")
        model.tie_weights()  # to_empty gives each name its own tensor: the tied head is tied again
        ids = torch.zeros((batch, seq), dtype=torch.long)
        t0 = time.process_time()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = st.plan(_loss_module(model), (ids,), machine=preset("h100", 1), fit=False, stages=False)
        mem = plan.memory
        row: dict[str, Any] = {"model": name, "size": "full", "batch": batch, "seq": seq,
                               "params": sum(p.numel() for p in model.parameters()),
                               "predicted_peak_bytes": mem["peak_bytes"], "predicted_weights_bytes": mem["weights_bytes"],
                               "predicted_activations_bytes": mem["activations_bytes"],
                               "predicted_transient_bytes": mem.get("transient_bytes", 0.0),
                               "plan_cpu_s": time.process_time() - t0}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            row["by_kind"] = by_kind(st.trace(_loss_module(model), (ids,))[0], plan.machine.dtype_bytes)
        g = gpu.get(name, {})
        if "peak_allocated_bytes" in g:
            row["gpu_peak_allocated_bytes"] = g["peak_allocated_bytes"]
            row["predicted_peak_over_gpu_peak"] = mem["peak_bytes"] / g["peak_allocated_bytes"]
        d = dev.get(name, {})
        if "kept_after_forward_bytes" in d:
            row.update({k: d[k] for k in ("state_bytes", "kept_after_forward_bytes", "saved_hook_bytes",
                                          "step_peak_bytes")})
            row["predicted_activations_over_kept"] = mem["activations_bytes"] / d["kept_after_forward_bytes"]
            row["predicted_weights_over_state"] = mem["weights_bytes"] / d["state_bytes"]
            row["step_peak_minus_predicted_peak_bytes"] = d["step_peak_bytes"] - mem["peak_bytes"]
            # what the step's peak holds beyond the state and what the forward pass kept: the backward's transient
            row["measured_transient_bytes"] = d["step_peak_bytes"] - d["state_bytes"] - d["kept_after_forward_bytes"]
            row["predicted_transient_over_measured"] = (mem.get("transient_bytes", 0.0)
                                                        / row["measured_transient_bytes"])
        rows.append(row)
        print(f"full {name}: predicted peak {mem['peak_bytes'] / 1e9:.2f} GB (weights {mem['weights_bytes'] / 1e9:.2f},"
              f" activations {mem['activations_bytes'] / 1e9:.2f}); GPU peak "
              f"{g.get('peak_allocated_bytes', float('nan')) / 1e9:.2f} GB; kept at backward "
              f"{d.get('kept_after_forward_bytes', float('nan')) / 1e9:.2f} GB", flush=True)
        del model, plan
    return rows


def _recorder(params: set[int], kept: dict[int, tuple[float, str]]) -> Any:
    """A pack hook recording each saved storage outside ``params``: data pointer -> (bytes, "shape dtype")."""
    def pack(t: Any) -> Any:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            kept[s.data_ptr()] = (float(s.nbytes()), f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}")
        return t

    return pack


def device_run(out: str, smoke: bool) -> None:
    """On a GPU (CPU with ``smoke``): per model, the memory a training step holds, measured by the allocator."""
    import torch

    from benchmarks.gpu_measure import SMOKE_MODELS, STEP_MODELS, build_model, describe

    dev = torch.device("cpu" if smoke else "cuda")
    cuda = dev.type == "cuda"
    machine = describe(dev)
    rows: list[dict[str, Any]] = []
    for name, (family, cfg, batch, seq) in (SMOKE_MODELS if smoke else STEP_MODELS).items():
        row: dict[str, Any] = {"model": name, "batch": batch, "seq": seq}
        try:
            with torch.device(dev):
                model = build_model(family, cfg, seq).to(torch.bfloat16)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)
            ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=dev)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            kept: dict[int, tuple[float, str]] = {}
            pack = _recorder({p.untyped_storage().data_ptr() for p in model.parameters()}, kept)

            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if cuda else 0
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = model(input_ids=ids, labels=ids).loss
            if cuda:
                torch.cuda.synchronize()
            after = torch.cuda.memory_allocated() if cuda else 0
            fwd_peak = torch.cuda.max_memory_allocated() if cuda else 0
            loss.backward()
            if cuda:
                torch.cuda.synchronize()
            kinds: dict[str, list[float]] = {}
            for nbytes, what in kept.values():
                kinds.setdefault(what, [0, 0.0])
                kinds[what][0] += 1
                kinds[what][1] += nbytes
            row.update({"state_bytes": base, "kept_after_forward_bytes": after - base,
                        "saved_hook_bytes": sum(v[0] for v in kept.values()), "forward_peak_bytes": fwd_peak,
                        "step_peak_bytes": torch.cuda.max_memory_allocated() if cuda else 0,
                        "saved_by_shape": sorted(([w, int(c), b] for w, (c, b) in kinds.items()),
                                                 key=lambda r: -r[2])[:16]})
            del model, opt, ids, loss
        except Exception as exc:  # noqa: BLE001  (one model's failure must not lose the others)
            row["error"] = repr(exc)[:400]
        if cuda:
            torch.cuda.empty_cache()
        rows.append(row)
        print(name, {k: v for k, v in row.items() if k != "saved_by_shape"}, flush=True)
        Path(out).parent.mkdir(parents=True, exist_ok=True)  # after every model: a cut-off run keeps its rows
        Path(out).write_text(json.dumps({"benchmark": "torch_memory_device", "machine": machine, "rows": rows},
                                        indent=1) + "\n")
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measured", default=str(HERE / "results" / "gpu_measure_h100.json"),
                    help="gpu_measure.py's JSON (section steps: the GPU's peak per model)")
    ap.add_argument("--device-measured", default=str(HERE / "results" / "torch_memory_device.json"),
                    help="this script's --device-run output (the bytes held at the start of the backward pass)")
    ap.add_argument("--device-run", metavar="PATH", help="measure on the GPU and write PATH (nothing else)")
    ap.add_argument("--smoke", action="store_true", help="--device-run on CPU with toy models")
    ap.add_argument("--no-full", action="store_true", help="the small CPU rows only")
    ap.add_argument("--out", default=str(HERE / "results" / "torch_memory.json"))
    a = ap.parse_args(argv)
    if a.device_run:
        device_run(a.device_run, a.smoke)
        return 0
    import torch_cases  # tests/: makes torchvision importable for transformers 5 (see there)

    torch_cases.enter_torchvision()
    import transformers

    from benchmarks.record import write_result

    load = os.getloadavg()
    t0, c0 = time.time(), time.process_time()
    rows = small_rows()
    if not a.no_full:
        measured = json.loads(Path(a.measured).read_text()) if os.path.exists(a.measured) else {}
        device = json.loads(Path(a.device_measured).read_text()) if os.path.exists(a.device_measured) else {}
        rows += full_rows(measured, device)
    write_result("torch_memory", a.out, rows, transformers=transformers.__version__,
                 measured=a.measured if not a.no_full else None, wall_s=time.time() - t0,
                 cpu_s=time.process_time() - c0, load_average=load)
    return 0


if __name__ == "__main__":
    sys.exit(main())
