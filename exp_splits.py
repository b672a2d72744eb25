"""Experiment: more splits at small decode batches (CUDA FP8 kernel), L2 emptied by reading, graph replay."""
import json, os, torch
from functools import partial
from pagedserve.bench import fp8 as B
from pagedserve.kernels import triton_attention as ta
gen = torch.Generator(device="cuda").manual_seed(2)
scale = torch.full((1,), 0.02, device="cuda")
B._spin_up()
rows = []
for batch, context in [(1, 4096), (8, 4096), (4, 8192), (16, 2048), (32, 1024), (64, 1024), (32, 512), (64, 4096)]:
    q, k, v, tables, lens, cu = B._decode_case(batch, context, torch.bfloat16, gen)
    bf = B._graph_ms_clean_l2(partial(ta.paged_attention, q, k, v, tables, lens, cu, 0.1)) * 1e3
    k8, v8 = B._fp8_copy(k), B._fp8_copy(v)
    del k, v
    auto = ta._cuda_decode_plan(batch, 32, 128, 8, 16, context // 16, torch.bfloat16, ta._sm_count(q.device),
                                ta.cuda_decode.fitted(ta.FP8_DECODE_CUDA, 8), None, False).num_splits
    row = {"batch": batch, "context": context, "bf16_us": bf, "auto": auto}
    for splits in sorted({auto, max(1, auto // 2), (3 * auto + 1) // 2, 2 * auto, 3 * auto, 4 * auto}):
        if context // splits < 32:
            continue
        f8 = B._graph_ms_clean_l2(partial(ta.paged_attention, q, k8, v8, tables, lens, cu, 0.1, k_scale=scale,
                                          v_scale=scale, num_splits=splits)) * 1e3
        row[f"s{splits}"] = f8
        print(f"({batch},{context}) bf16 {bf:6.1f} us  splits {splits:3d}{' (auto)' if splits == auto else '       '}"
              f" fp8 {f8:6.1f} us ratio {bf / f8 / 2:.3f}", flush=True)
    rows.append(row)
    del q, k8, v8
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "splits.json"), "w"), indent=1)
