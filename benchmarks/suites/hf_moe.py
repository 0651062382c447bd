"""Suite 15, `hf-moe`: a Hugging Face Qwen3-MoE trained unchanged, its experts divided.

The model: transformers' Qwen3MoeForCausalLM (a tiny config made here, no download), 4 layers,
8 experts, top-2, its experts module captured on Piper's MoE primitives
(`piper/frontend/hf_experts.py`).

(a) dp=2: the experts replicated (plain `dp`) vs divided (`dp` + `expert_parallel`), the two
    jobs alternating step by step on the same batches: step time, and each device's
    parameter bytes and expert bytes (`job.memory()[rank]["params"]`); beside them
    transformers' own expert parallelism on the same weights and batches
    (`DistributedConfig(ep_size=2, fsdp_size=2)`, benchmarks/baselines/hf_own_ep.py), run after them.
(b) pp=2 x dp=2 with `expert_parallel`, 1F1B and DualPipeV (one job at a time): step time
    and parameter bytes per device, beside plain dp=4 with the experts replicated.

    python -m benchmarks --suite hf-moe [--quick]
"""
from __future__ import annotations

import functools
import statistics
import time

import torch
import torch.nn.functional as F

import piper
from piper.dsl import load_strategy

from ..harness.divided_experts import EP_AGAINST_DP, divided_and_replicated
from ..harness.machine import ray_cluster
from ..harness.results import SuiteResult, Table, mib, ms, short_error


class _CausalLM(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.m = model

    def forward(self, idx, targets):
        return F.cross_entropy(self.m(input_ids=idx).logits.flatten(0, 1), targets.flatten())


def _model(quick: bool, stages: int = 1):
    import transformers

    hidden, inter, seq = (32, 32, 16) if quick else (128, 128, 64)
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * inter,
                                      moe_intermediate_size=inter, num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                                      max_position_embeddings=seq, decoder_sparse_step=1)
    model = _CausalLM(transformers.Qwen3MoeForCausalLM(cfg))
    if stages > 1:
        per = 4 // stages
        groups = [[f"m.model.layers.{i}" for i in range(s * per, (s + 1) * per)] for s in range(stages)]
        groups[0].insert(0, "m.model.embed_tokens")
        groups[-1] += ["m.model.norm", "m.lm_head"]
        piper.annotate_modules(model, "PP", groups)
    return model, seq


def _batches(quick: bool, n: int, seq: int):
    batch = 16 if quick else 32
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        t = torch.randint(0, 256, (batch, seq + 1), generator=g)
        out.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
    return out


def _expert_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)


def run(ctx) -> SuiteResult:
    quick = ctx.quick
    result = SuiteResult("hf-moe", 15, "Hugging Face Qwen3-MoE: experts divided vs replicated; EP under pipelines",
                         ctx.command("hf-moe"))
    warmup, steps = (2, 4) if quick else (3, 10)
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-3)
    with ray_cluster():
        result.tables.append(_divided_vs_replicated(result, quick, optimizer, warmup, steps))
        result.tables.append(_under_pipelines(result, quick, optimizer, warmup, steps))
    return result


def _divided_vs_replicated(result, quick, optimizer, warmup, steps) -> Table:
    table = Table("(a) Qwen3-MoE, dp=2: experts replicated vs divided (jobs alternate step by step)",
                  ["strategy", "step ms (median)", "params MiB / device", "expert MiB / device", "ratio"])
    model, seq = _model(quick)
    batches = _batches(quick, warmup + steps, seq)
    experts = _expert_bytes(model)
    timings, memory = divided_and_replicated(model, batches, optimizer, warmup, steps, progress=False)
    base = timings.median("dp")
    for name in EP_AGAINST_DP:
        med = timings.median(name)
        held = experts / 2 if "expert" in name else experts
        table.add(name, ms(med), mib(memory[name]), mib(held), med / base if med and base else None)
        key = "ep" if "expert" in name else "dp"
        result.metrics[f"{key}.step_ms"] = ms(med)
        result.metrics[f"{key}.params_bytes"] = float(memory[name])
    result.metrics["ep_vs_dp.params_ratio"] = memory["dp + expert_parallel"] / memory["dp"]
    from ..baselines.hf_own_ep import measure

    own = measure(model.m, batches, world=2, warmup=warmup)
    name = "transformers' own EP (ep_size=2, fsdp_size=2)"
    if "error" in own:
        table.add(name, None, None, None, None)
        table.notes.append(f"{name} failed: {own['error']}")
    else:
        table.add(name, ms(own["step_s"]), None, mib(own["expert_bytes"]), own["step_s"] / base if base else None)
        result.metrics["hf_ep.step_ms"] = ms(own["step_s"])
        result.metrics["hf_ep.expert_bytes"] = float(own["expert_bytes"])
        table.notes.append(f"transformers' own EP: FSDP2 shards the dense weights too (its params per device are "
                           f"not comparable, so not shown); its first loss {own['losses'][0]:.6f} against "
                           f"Piper's {timings.losses['dp + expert_parallel'][0]:.6f} on the same weights and batch.")
    gap = timings.max_loss_gap("dp", "dp + expert_parallel")
    table.notes.append(f"ratio: step time over plain dp's. Largest loss difference between the two jobs over "
                       f"{warmup + steps} steps: {gap:.2e} (float32; the same model either way).")
    return table


def _under_pipelines(result, quick, optimizer, warmup, steps) -> Table:
    table = Table("(b) Qwen3-MoE, 4 devices: plain dp=4 vs pp=2 x dp=2 with expert_parallel (one job at a time)",
                  ["strategy", "step ms (median)", "params MiB / device (max)", "ratio"])
    m = 4
    cases = [("dp=4, experts replicated", "use dp() on dp\n", {"dp": 4}, 1),
             ("1F1B x EP", f"use one_f_one_b(microbatches={m}) on pp\nuse dp() on dp\nuse expert_parallel() on dp\n",
              {"dp": 2, "pp": 2}, 2),
             ("DualPipeV x EP", f"use dualpipev(microbatches={m}) on pp\nuse dp() on dp\nuse expert_parallel() on dp\n",
              {"dp": 2, "pp": 2}, 4)]
    medians = {}
    for name, text, mesh, stages in cases:
        model, seq = _model(quick, stages)
        batches = _batches(quick, warmup + steps, seq)
        try:
            with piper.compile(model, batches[0], strategy=load_strategy(text), mesh=mesh, optimizer=optimizer,
                               progress=False) as job:
                times = []
                for i, b in enumerate(batches):
                    t0 = time.perf_counter()
                    job.step(*b)
                    if i >= warmup:
                        times.append(time.perf_counter() - t0)
                held = max(v["params"] for v in job.memory().values())
        except Exception as exc:       # one failing strategy still leaves the others' rows
            table.add(name, None, None, None)
            table.notes.append(f"{name} failed: {short_error(exc)}")
            continue
        medians[name] = statistics.median(times)
        first = medians.get(cases[0][0])
        table.add(name, ms(medians[name]), mib(held), medians[name] / first if first else None)
        key = name.split(",")[0].replace(" ", "_").replace("=", "").lower()
        result.metrics[f"{key}.step_ms"] = ms(medians[name])
        result.metrics[f"{key}.params_bytes"] = float(held)
    table.notes.append("ratio: step time over plain dp=4's. On 2 shared CPU cores 4 workers contend for the "
                       "cores; EP's gain here is the memory (each device holds 1/2 of the experts), the exchanges "
                       "(a counts exchange and two uneven all-to-alls each way per MoE layer) cost time.")
    return table
