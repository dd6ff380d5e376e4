"""Where a training step's time goes, and whether it waits on the host: the profile and the
sync check of scripts/bench/gpu_gpt.py (run inside its worker, on a row's built model).

profile_steps: torch.profiler over a few steps (after the timed ones). It writes a Chrome
trace (open it in chrome://tracing or https://ui.perfetto.dev) and sums the device time of
each kernel class per step, by the kernel's name (KERNEL_CLASSES, first match wins), next
to the device's busy time (the union of all kernels' intervals, every stream), the profiled
steps' wall time, and the gap between them: the time the GPU sat idle waiting for the host
(launch overhead, Python, synchronisation). The unprofiled step time of the same row gives
the gap without the profiler's own overhead (`gap_ms`); `gap_ms_profiled` is the upper bound.
On the CPU there are no device kernels: the CPU operators' self time is classified by the
same rules instead (`source: "cpu ops (self time)"`), so the code path runs everywhere.

sync_check: runs steps under torch.cuda.set_sync_debug_mode("error"), where any
device-to-host synchronisation (.item(), a blocking copy, a stream sync) raises. The first
error's message and the phase of the step it came from (forward, backward, optimizer,
zero_grad) are the evidence; the step is then rerun without the debug mode, so the row goes
on. One more step under "warn" counts the synchronisations per phase (Python warnings and
the C++ warnings megatorch's pybind11 modules print to stderr). Without CUDA it records
"skipped: no CUDA".
"""
import os
import re
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

CLASSES = ("GEMM", "attention", "norm", "elementwise", "optimizer", "communication", "other")
# (class, regular expression over the lower-cased kernel or operator name); first match wins.
# The order matters: flash attention kernels are CUTLASS kernels, "vectorized_layer_norm" is
# vectorized, the optimizer's multi-tensor L2 norm is a norm.
KERNEL_CLASSES = (
    ("communication", r"nccl|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|c10d::|gloo"),
    ("attention", r"flash|fmha|sdpa|scaled_dot_product|attention|cudnn"),
    ("optimizer", r"adam|multi_tensor|foreach|l2norm|sgd_|zero_grad|optimizer"),
    ("GEMM", r"gemm|gemv|cutlass|cublas|xmma|nvjet|s16816|s1688|splitk|matmul|\bmm\b|addmm|bmm|linear"),
    ("norm", r"norm|gammabeta|rowwisemoments"),
    ("elementwise", r"elementwise|vectorized|unrolled|reduce|softmax|cross_entropy|nll_loss|gelu|silu|swiglu|"
                    r"glu|rotary|rope|dropout|bias|embedding|index|copy|fill|cat\b|catarray|where|mul|add|sum|"
                    r"mean|pow|rsqrt|neg|exp|to_copy|clone|transpose|permute|contiguous|gather|scatter|arange|"
                    r"masked|triu|tril|view_as|polar|complex|sub|div|sqrt|addc|lerp|clamp|maximum"),
    ("other", r""),
)
_RULES = [(c, re.compile(p)) for c, p in KERNEL_CLASSES]
SYNC_WORDS = ("synchroniz",)  # torch's message: "called a synchronizing CUDA operation"
ANNOTATIONS = ("step::", "Optimizer.", "ProfilerStep", "## ")  # record_function ranges, not kernels


def classify(name: str) -> str:
    low = name.lower()
    for cls, rule in _RULES:
        if rule.search(low):
            return cls
    return "other"


def union_us(intervals) -> float:
    """Total length of the union of (start, end) intervals."""
    total, end = 0.0, None
    start = None
    for s, e in sorted(intervals):
        if end is None or s > end:
            if end is not None:
                total += end - start
            start, end = s, e
        else:
            end = max(end, e)
    if end is not None:
        total += end - start
    return total


def summarize(kernels, steps: int, wall_s: float, step_ms, source: str) -> dict:
    """kernels: (name, start_us, end_us) device kernels, or (name, None, self_us) CPU operators.
    Per step: ms per class, their sum, the busy union (device only), the wall time, the gaps."""
    per_class = {c: 0.0 for c in CLASSES}
    by_name = {}
    intervals = []
    for name, start, end in kernels:
        dur = end - start if start is not None else end
        cls = classify(name)
        per_class[cls] += dur
        key = name[:140]
        t, _ = by_name.get(key, (0.0, cls))
        by_name[key] = (t + dur, cls)
        if start is not None:
            intervals.append((start, end))
    ms = 1e-3 / steps
    out = {"source": source, "steps": steps,
           "class_ms": {c: round(v * ms, 3) for c, v in per_class.items()},
           "kernel_ms": round(sum(per_class.values()) * ms, 3),
           "wall_ms_profiled": round(wall_s * 1e3 / steps, 3), "step_ms": step_ms}
    if intervals:  # device kernels: what the GPU did against what the step took
        busy = union_us(intervals) * ms
        out["busy_ms"] = round(busy, 3)
        out["gap_ms_profiled"] = round(out["wall_ms_profiled"] - busy, 3)
        if step_ms:
            out["gap_ms"] = round(max(0.0, step_ms - busy), 3)
            out["gap_fraction"] = round(out["gap_ms"] / step_ms, 4)
        out["share_of"] = "step_ms" if step_ms else "wall_ms_profiled"
    else:  # CPU operators' self time, all timed under the profiler: compare with the profiled step
        out["busy_ms"] = out["gap_ms"] = None
        out["gap_ms_profiled"] = round(out["wall_ms_profiled"] - out["kernel_ms"], 3)  # outside any operator
        out["share_of"] = "wall_ms_profiled"
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:12]
    out["top"] = [{"name": k, "class": c, "ms": round(t * ms, 3)} for k, (t, c) in top]
    out["events"] = len(kernels)
    return out


def profile_steps(step, device: str, steps: int, trace_path: Path, step_ms=None) -> dict:
    """Runs `steps` steps (`step(mark)`, mark(phase) at each phase) under torch.profiler, writes
    the Chrome trace, returns summarize()'s table (plus the trace's file name and the time the
    profile took). User annotations (the step:: ranges) are not operators: left out of the sums."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    t_all = time.time()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    if device == "cuda":
        torch.cuda.synchronize()
    phase = {"range": None}

    def mark(p):  # each phase of the step a range in the trace: step::forward, step::backward, ...
        if phase["range"] is not None:
            phase["range"].__exit__(None, None, None)
        phase["range"] = torch.profiler.record_function(f"step::{p}") if p else None
        if phase["range"] is not None:
            phase["range"].__enter__()

    with profile(activities=activities, record_shapes=False, with_stack=False) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step(mark)
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    if device == "cuda":
        # Device events are kernels, memcpy and memset; record_function ranges (the step:: phases,
        # Optimizer.step#...) also appear on the device as annotations spanning kernels: left out.
        kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
                   and not e.name.startswith(ANNOTATIONS)]
        source = "cuda kernels (device time)"
    else:
        kernels = [(e.key, None, e.self_cpu_time_total) for e in prof.key_averages()
                   if e.self_cpu_time_total > 0 and not e.key.startswith("step::")]
        source = "cpu ops (self time): no device kernels on the CPU"
    out = summarize(kernels, steps, wall, step_ms, source)
    try:
        prof.export_chrome_trace(str(trace_path))
        out["trace"] = trace_path.name
    except Exception as e:  # the table is the result; the trace is for a person
        out["trace_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    out["seconds"] = round(time.time() - t_all, 1)
    return out


class SyncCheckBroken(RuntimeError):
    """The step rerun after a caught synchronisation failed (a model or optimizer left half-way
    through a step): the worker rebuilds the row without the sync check and keeps `result`."""

    def __init__(self, result):
        super().__init__(result.get("rerun_failed", "sync check broke the step"))
        self.result = result


def _where(e: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "/torch/" not in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    return f"{'/'.join(Path(f.filename).parts[-3:])}:{f.lineno} ({f.name})"


def sync_check(step, reset, device: str, steps: int, first_index: int) -> dict:
    """`step(mark)` runs one training step calling mark(phase) as it goes; `reset()` clears
    what a failed step left (the gradients). Steps first_index..first_index+steps-1 run under
    set_sync_debug_mode("error"); one more under "warn" counts syncs per phase."""
    if device != "cuda":
        return {"status": "skipped: no CUDA"}
    out = {"mode": "error", "steps": list(range(first_index, first_index + steps)), "synchronized": False,
           "steps_with_sync": 0}
    phase = {"now": None}

    def mark(p):
        phase["now"] = p

    for i in range(steps):
        torch.cuda.synchronize()
        failed = None
        torch.cuda.set_sync_debug_mode("error")
        try:
            step(mark)
        except RuntimeError as e:
            if not any(w in str(e) for w in SYNC_WORDS):
                raise
            failed = {"step": first_index + i, "phase": phase["now"], "where": _where(e),
                      "message": str(e).strip().splitlines()[0][:300]}
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if failed is not None:  # out of the except block: the failed step's frames are gone
            out["synchronized"] = True
            out["steps_with_sync"] += 1
            out.setdefault("first", failed)
            reset()
            try:
                step(mark)  # the same step again, without the debug mode
            except Exception as e:
                if "out of memory" in str(e).lower():
                    raise
                out["rerun_failed"] = f"{type(e).__name__} at {_where(e)}: {str(e).strip()[:200]}"
                raise SyncCheckBroken(out) from e
    torch.cuda.synchronize()
    # Every synchronisation of one step, by phase (warnings do not stop the step). A warning
    # raised under a torch binding becomes a Python warning; one raised inside megatorch's C++
    # modules called through pybind11 goes to stderr: both are counted (stderr captured at fd 2).
    counts = {}
    with warnings.catch_warnings(record=True) as caught, tempfile.TemporaryFile() as err:
        warnings.simplefilter("always")
        seen = [0]

        def count(p):
            err.seek(0)
            n = err.read().decode(errors="replace").count("synchronizing CUDA operation")
            n += sum(1 for w in caught if any(s in str(w.message) for s in SYNC_WORDS))
            if phase["now"] is not None and n > seen[0]:
                counts[phase["now"]] = counts.get(phase["now"], 0) + n - seen[0]
            seen[0] = n
            phase["now"] = p

        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(count)
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
            count(None)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
    out["warn_step_syncs_by_phase"] = counts
    torch.cuda.synchronize()
    return out


def markdown(profiles: dict, size: str) -> list:
    """The side-by-side table: class | <impl> ms/step | share | ... for each profiled impl."""
    impls = [i for i in profiles if profiles[i]]
    if not impls:
        return []
    src = profiles[impls[0]]["source"]
    lines = [f"Profile at {size} ({profiles[impls[0]]['steps']} steps after the timed ones; {src}; classes by "
             "kernel name, gpt_profile.KERNEL_CLASSES):", "",
             "| per step | " + " | ".join(f"{i} ms | {i} share" for i in impls) + " |",
             "|---|" + "---|---|" * len(impls)]

    def cell(p, v):
        base = p.get(p.get("share_of", "wall_ms_profiled"))
        return f"{v:.3g} | {100 * v / base:.1f}%" if base else f"{v:.3g} | –"

    for c in CLASSES:
        lines.append(f"| {c} | " + " | ".join(cell(profiles[i], profiles[i]["class_ms"][c]) for i in impls) + " |")
    rows = [("kernels summed", "kernel_ms"), ("device busy (union)", "busy_ms"),
            ("step (timed, unprofiled)", "step_ms"),
            ("idle/launch gaps (step - busy)", "gap_ms"), ("step under the profiler", "wall_ms_profiled"),
            ("gaps under the profiler", "gap_ms_profiled")]
    for label, key in rows:
        lines.append(f"| {label} | " + " | ".join(cell(profiles[i], profiles[i][key]) if profiles[i].get(key)
                                                  is not None else "– | –" for i in impls) + " |")
    traces = ", ".join(f"{i}: {profiles[i].get('trace', profiles[i].get('trace_error', '–'))}" for i in impls)
    lines.append(f"\nShares: of the timed (unprofiled) step for device kernels, of the step under the profiler for "
                 f"CPU operators. Traces: {traces}")
    return lines


def _self_test():
    """python3 scripts/bench/gpt_profile.py: the rule table on kernel names seen on Hopper, and
    sync_check's control flow against a fake CUDA (a step that syncs in its optimizer)."""
    names = {
        "nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT": "GEMM",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_"
        "kernel__5x_cublas": "GEMM",
        "void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<...>>": "GEMM",
        "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>": "GEMM",
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>, true>": "attention",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>": "attention",
        "cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1_kernel0_0": "attention",
        "fmha_cutlassF_bf16_aligned_64x128_rf_sm80": "attention",
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>": "norm",
        "void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernelTemplate<...>": "norm",
        "void megatorch::kernels::(anonymous namespace)::norm_forward_kernel<c10::BFloat16>": "norm",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>": "elementwise",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, ...>>": "elementwise",
        "void megatorch::kernels::(anonymous namespace)::swiglu_forward_kernel<c10::BFloat16>": "elementwise",
        "void megatorch::kernels::(anonymous namespace)::cross_entropy_local_kernel<c10::BFloat16>": "elementwise",
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, ...>": "elementwise",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>": "elementwise",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor<...>>": "optimizer",
        "void megatorch::kernels::(anonymous namespace)::adamw_kernel<float>": "optimizer",
        "void at::native::multi_tensor_apply_kernel<at::native::TensorListMetadata<2>, CopyFunctor<...>>": "optimizer",
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "communication",
        "Memcpy DtoD (Device -> Device)": "other",
        "Memset (Device)": "other",
        "aten::mm": "GEMM", "aten::addmm": "GEMM", "aten::native_layer_norm_backward": "norm",
        "aten::_scaled_dot_product_flash_attention_for_cpu": "attention", "aten::_fused_adamw_": "optimizer",
        "aten::gelu": "elementwise",
    }
    wrong = {n: (classify(n), c) for n, c in names.items() if classify(n) != c}
    assert not wrong, wrong
    s = summarize([("nvjet_a", 0.0, 600.0), ("flash_fwd", 500.0, 900.0), ("aten_add elementwise", 1000.0, 1100.0)],
                  steps=1, wall_s=2e-3, step_ms=1.5, source="test")
    assert s["kernel_ms"] == 1.1 and s["busy_ms"] == 1.0 and s["gap_ms"] == 0.5 and s["gap_ms_profiled"] == 1.0, s

    class FakeCuda:  # the debug mode as torch keeps it, and a step whose optimizer reads the device
        mode = "default"
        set_sync_debug_mode = staticmethod(lambda m: setattr(FakeCuda, "mode", m))
        synchronize = staticmethod(lambda: None)

    calls = []

    def step(mark=lambda p: None):
        mark("forward")
        mark("optimizer")
        calls.append(FakeCuda.mode)
        if FakeCuda.mode == "error":
            raise RuntimeError("called a synchronizing CUDA operation")
        if FakeCuda.mode == "warn":
            warnings.warn("called a synchronizing CUDA operation")
        mark(None)

    real, torch.cuda = torch.cuda, FakeCuda
    try:
        out = sync_check(step, lambda: None, "cuda", 3, 4)
    finally:
        torch.cuda = real
    assert out["synchronized"] and out["steps_with_sync"] == 3 and out["first"]["step"] == 4, out
    assert out["first"]["phase"] == "optimizer" and out["warn_step_syncs_by_phase"] == {"optimizer": 1}, out
    assert calls == ["error", "default"] * 3 + ["warn"], calls
    assert sync_check(step, lambda: None, "cpu", 3, 4) == {"status": "skipped: no CUDA"}

    def broken_step(mark=lambda p: None):  # the rerun after the caught sync fails too
        mark("backward")
        raise RuntimeError("called a synchronizing CUDA operation" if FakeCuda.mode == "error" else "bucket state")

    torch.cuda = FakeCuda
    try:
        sync_check(broken_step, lambda: None, "cuda", 3, 4)
        raise AssertionError("no SyncCheckBroken")
    except SyncCheckBroken as e:
        assert e.result["first"]["phase"] == "backward" and "bucket state" in e.result["rerun_failed"], e.result
    finally:
        torch.cuda = real
    print("gpt_profile self-test: ok")


if __name__ == "__main__":
    _self_test()
