"""bench/timeline.py's reading of a GPU profile: the kernels' busy time is the union of their intervals, kernels are
sorted by kind from their names, and the host's synchronising runtime calls are counted (a trace written by hand in
the profiler's Chrome format: this box has no GPU to profile)."""

from bench.timeline import busy_time, kernel_kind, trace_summary


def test_busy_time_is_the_union_of_the_intervals():
    assert busy_time([]) == 0.0
    assert busy_time([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17.0  # 0-12 and 20-25
    assert busy_time([(20, 25), (0, 10), (10, 11)]) == 16.0


def test_kernels_are_sorted_by_kind_from_their_names():
    names = {
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT": "matmul",
        "void cutlass::Kernel2<cutlass_75_tensorop_bf16_s1688gemm_bf16_256x128_32x2_nn_align8>(Params)": "matmul",
        "void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>(Flash_fwd_params)": "attention",
        "void multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor<float>>(long, int)": "optimizer",
        "triton_poi_fused_add_mul_0": "triton",
        "_rms_norm_forward_kernel": "triton",
        "void at::native::elementwise_kernel<128, 2, direct_copy_kernel_cuda>(int, Loop)": "copy",
        "void at::native::reduce_kernel<512, 1, ReduceOp<float, MaxOps<float>>>(ReduceOp)": "reduction",
        "void at::native::vectorized_elementwise_kernel<4, MulFunctor<float>>(int, MulFunctor, Array)": "element-wise",
        "some_unnamed_thing": "other",
    }
    assert {name: kernel_kind(name) for name in names} == names


def test_a_trace_summary_counts_busy_time_kinds_and_syncs():
    def event(cat, name, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    trace = {
        "traceEvents": [
            event("cpu_op", "aten::mm", 0, 5000),  # host operators are not on the device's timeline
            event("cuda_runtime", "cudaLaunchKernel", 100, 10),
            event("kernel", "nvjet_tst_128x256", 200, 300),
            event("kernel", "void at::native::vectorized_elementwise_kernel<4, Mul>", 400, 200),  # overlaps
            event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 900, 100),
            event("cuda_runtime", "cudaStreamSynchronize", 700, 350),
            event("cuda_runtime", "cudaMemcpyAsync", 890, 20),  # asynchronous: not a wait
            event("cuda_runtime", "cudaDeviceSynchronize", 1050, 50),
            {"ph": "i", "name": "marker", "ts": 3000},
        ]
    }
    summary = trace_summary(trace)
    assert summary["wall_s"] == 1000e-6  # from the first launch (100) to the last sync's end (1100)
    assert summary["gpu_busy_s"] == 500e-6  # 200-600 and 900-1000
    assert summary["gpu_busy_share"] == 0.5
    assert summary["kernels"] == 3
    assert summary["kernel_s_by_kind"] == {"matmul": 300e-6, "element-wise": 200e-6, "copy": 100e-6}
    assert summary["top_kernels"][0] == ["nvjet_tst_128x256", 1, 300e-6] and len(summary["top_kernels"]) == 3
    assert summary["runtime_syncs"] == 2
    assert summary["runtime_sync_s"] == 400e-6


def test_the_peak_breakdown_replays_allocations_and_frees_to_the_largest_total():
    from bench.peak_memory import BEFORE, GIB, allocation_site, peak_breakdown

    def frames(*where):
        return [{"filename": f, "line": line, "name": "f"} for f, line in where]

    head = frames(("/x/torch/nn/functional.py", 9), ("/x/site-packages/transformers/models/q.py", 40))
    ours = frames(("/x/torch/_tensor.py", 1), ("/repo/openppo/models/lm_head.py", 76), ("/repo/openppo/ppo/fit.py", 5))
    assert allocation_site(head) == "transformers/models/q.py:40 (f)"
    assert allocation_site(ours) == "openppo/models/lm_head.py:76 (f)"
    assert allocation_site(frames(("/x/torch/_tensor.py", 3))) == "_tensor.py:3 (f)"
    trace = [
        {"action": "alloc", "addr": 1, "size": 2 * GIB, "frames": head},
        {"action": "alloc", "addr": 2, "size": 1 * GIB, "frames": ours},
        {"action": "free_requested", "addr": 2, "size": 1 * GIB},  # not freed yet: still counted
        {"action": "free_completed", "addr": 100, "size": 1 * GIB},  # a block allocated before the trace
        {"action": "alloc", "addr": 3, "size": 3 * GIB, "frames": ours},  # the peak: 4 - 1 + 2 + 1 + 3 = 9
        {"action": "free_completed", "addr": 2, "size": 1 * GIB},
        {"action": "free_completed", "addr": 3, "size": 3 * GIB},
        {"action": "alloc", "addr": 4, "size": 4 * GIB, "frames": head},  # 4 - 1 + 2 + 4 = 9: not above
    ]
    result = peak_breakdown(trace, start_bytes=4 * GIB, top=1)
    assert result["peak_gib"] == 9.0
    assert result["by_site_gib"] == {BEFORE: 3.0, "openppo/models/lm_head.py:76 (f)": 4.0}
    assert result["other_sites_gib"] == 2.0


def test_small_kernels_are_charged_to_the_python_line_and_operator_that_launched_them():
    """A kernel is found by its correlation id at its launch on the host, inside the innermost frame of the project
    (or transformers) and the outermost operator there; matmuls and other threads' intervals are left out."""
    from bench.timeline import kernel_time_by_source

    def span(cat, name, ts, dur, tid=1, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": args}

    norm = "transformers/models/qwen2/modeling_qwen2.py(60): forward"
    trace = {
        "traceEvents": [
            span("python_function", "openppo/models/actor.py(200): forward", 0, 1000),
            span("python_function", "torch/nn/modules/module.py(1773): _call_impl", 10, 980),
            span("python_function", norm, 20, 300),
            span("cpu_op", "aten::to", 30, 100),  # the outermost operator: its copy_ inside is not the source
            span("cpu_op", "aten::copy_", 40, 80),
            span("cuda_runtime", "cudaLaunchKernel", 50, 5, correlation=7),
            span("cpu_op", "aten::mul", 200, 50),
            span("cuda_runtime", "cudaLaunchKernel", 210, 5, correlation=8),
            span("cpu_op", "aten::mm", 400, 50),  # a matmul: not a small kernel
            span("cuda_runtime", "cudaLaunchKernel", 410, 5, correlation=9),
            span("cpu_op", "aten::add", 45, 10, tid=2),  # another thread's, around the same time
            span("cuda_runtime", "cudaLaunchKernel", 600, 5, correlation=10),  # under actor.py, no operator
            span("kernel", "void at::native::unrolled_elementwise_kernel<copy>", 500, 40, correlation=7),
            span("kernel", "void at::native::vectorized_elementwise_kernel<4, Mul>", 540, 20, correlation=8),
            span("kernel", "nvjet_tst_128x256", 560, 300, correlation=9),
            span("kernel", "void at::native::vectorized_elementwise_kernel<4, Add>", 860, 10, correlation=10),
            span("kernel", "void at::native::vectorized_elementwise_kernel<4, Add>", 870, 10, correlation=10),
        ]
    }
    rows = kernel_time_by_source(trace, ("copy", "element-wise"))
    assert rows == [
        [f"{norm} | aten::to", 1, 40e-6],
        [f"{norm} | aten::mul", 1, 20e-6],
        ["openppo/models/actor.py(200): forward | -", 2, 20e-6],
    ]
