"""M2PO (paper objective and released variant) against slow, direct reference implementations."""

from __future__ import annotations

import math
import os

import pytest
import torch

from astralight.rl.m2po import (
    gather_flat,
    harmful_token_mask,
    m2_harmful_clip,
    m2_select,
    m2_select_global,
    m2po_harmful_loss,
    m2po_keep_mask,
    m2po_loss,
    solve_harmful_tau,
)
from tests.conftest import free_port

# ----------------------------------------------------------------------------- references


def reference_m2po(logp, logp_b, adv, mask, threshold):
    """Paper M2PO with python loops: returns (masked flat positions, loss, m2_before, m2_after)."""
    positions = [(i, j) for i in range(mask.shape[0]) for j in range(mask.shape[1]) if mask[i, j]]
    sq = [float(logp[p] - logp_b[p]) ** 2 for p in positions]
    n = len(positions)
    order = sorted(range(n), key=lambda t: -sq[t])  # python's sort is stable: ties by position
    k = 0
    while k < n and sum(sq[t] for t in order[k:]) / (n - k) > threshold:
        k += 1
    masked = {positions[t] for t in order[:k]}
    kept = [t for t in range(n) if positions[t] not in masked]
    loss = -sum(math.exp(float(logp[positions[t]] - logp_b[positions[t]])) * float(adv[positions[t]])
                for t in kept) / max(n, 1)
    m2_before = sum(sq) / n if n else 0.0
    m2_after = sum(sq[t] for t in kept) / len(kept) if kept else 0.0
    return masked, loss, m2_before, m2_after


def random_batch(seed, b=6, t=12, scale=0.3, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logp_b = -torch.rand(b, t, generator=g, dtype=dtype) * 3
    logp = logp_b + torch.randn(b, t, generator=g, dtype=dtype) * scale
    mask = torch.rand(b, t, generator=g) < 0.7
    adv = torch.randn(b, generator=g, dtype=dtype)[:, None] * mask
    return logp, logp_b, adv, mask


# ----------------------------------------------------------------------------- paper objective


@pytest.mark.parametrize("seed,scale,threshold", [(0, 0.3, 0.04), (1, 0.1, 0.04), (2, 0.5, 0.04),
                                                  (3, 0.3, 0.01), (4, 1.0, 0.2), (5, 0.05, 0.04)])
def test_m2po_matches_reference(seed, scale, threshold):
    logp, logp_b, adv, mask = random_batch(seed, scale=scale)
    logp = logp.clone().requires_grad_(True)
    loss, metrics = m2po_loss(logp, logp_b, adv, mask, threshold)
    keep, _ = m2po_keep_mask(logp.detach(), logp_b, mask, threshold)
    masked_ref, loss_ref, m2b_ref, m2a_ref = reference_m2po(logp.detach(), logp_b, adv, mask,
                                                            threshold)
    masked = {tuple(p) for p in (mask & ~keep).nonzero().tolist()}
    assert masked == masked_ref
    assert not bool((keep & ~mask).any())
    assert float(loss.detach()) == pytest.approx(loss_ref, rel=1e-9, abs=1e-12)
    assert float(metrics["m2_before"]) == pytest.approx(m2b_ref, rel=1e-6)
    assert float(metrics["m2_after"]) == pytest.approx(m2a_ref, rel=1e-6, abs=1e-12)
    assert float(metrics["m2_after"]) <= threshold + 1e-12
    assert float(metrics["masked_fraction"]) == pytest.approx(len(masked_ref) / int(mask.sum()))
    # gradient: d loss / d logp = -keep * r * A / n on kept tokens, exactly 0 elsewhere
    loss.backward()
    n = int(mask.sum())
    expected = torch.where(keep, -torch.exp(logp.detach() - logp_b) * adv / n, 0.0)
    torch.testing.assert_close(logp.grad, expected)


def test_mask_is_minimal_prefix():
    """Masking one token fewer than chosen would leave the mean above the threshold."""
    g = torch.Generator().manual_seed(7)
    sq = torch.rand(200, generator=g, dtype=torch.float64) ** 4 * 0.5
    sel = m2_select(sq, 0.04)
    assert 0 < sel.n_masked < 200
    kept = sq[sel.keep]
    assert float(kept.mean()) <= 0.04
    # every masked value is >= every kept value, and putting back the smallest masked one breaks it
    assert float(sq[~sel.keep].min()) >= float(kept.max())
    back = torch.cat([kept, sq[~sel.keep].min().reshape(1)])
    assert float(back.mean()) > 0.04


def test_all_under_threshold_masks_nothing():
    logp, logp_b, adv, mask = random_batch(3, scale=0.01)
    loss, metrics = m2po_loss(logp, logp_b, adv, mask, 0.04)
    assert float(metrics["masked_fraction"]) == 0.0
    assert float(metrics["m2_after"]) == pytest.approx(float(metrics["m2_before"]))
    plain = -(torch.exp(logp - logp_b) * adv)[mask].sum() / mask.sum()
    assert float(loss) == pytest.approx(float(plain), rel=1e-12)


def test_huge_outliers_are_masked_first():
    b, t = 4, 10
    logp_b = torch.full((b, t), -1.0, dtype=torch.float64)
    logp = logp_b + 0.01
    logp[1, 3] += 5.0
    logp[2, 7] -= 8.0
    mask = torch.ones(b, t, dtype=torch.bool)
    adv = torch.ones(b, t, dtype=torch.float64)
    keep, sel = m2po_keep_mask(logp, logp_b, mask, 0.04)
    assert sel.n_masked == 2
    assert not keep[1, 3] and not keep[2, 7]
    assert int(keep.sum()) == b * t - 2
    assert float(sel.m2_after) == pytest.approx(1e-4)
    # the outliers carry no loss and no gradient; the rest contribute r * A / n
    logp = logp.clone().requires_grad_(True)
    loss, _ = m2po_loss(logp, logp_b, adv, mask, 0.04)
    assert float(loss.detach()) == pytest.approx(-(b * t - 2) * math.exp(0.01) / (b * t))
    loss.backward()
    assert logp.grad[1, 3] == 0 and logp.grad[2, 7] == 0


def test_inf_and_nan_tokens_are_masked_and_gradients_stay_finite():
    logp, logp_b, adv, mask = random_batch(11, scale=0.05, dtype=torch.float32)
    i, j = mask.nonzero()[0].tolist()
    k, m = mask.nonzero()[1].tolist()
    logp_b[i, j] = -float("inf")
    logp_b[k, m] = float("nan")
    logp = logp.clone().requires_grad_(True)
    loss, metrics = m2po_loss(logp, logp_b, adv, mask, 0.04)
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(logp.grad).all()
    assert logp.grad[i, j] == 0 and logp.grad[k, m] == 0
    assert float(metrics["masked_fraction"]) >= 2 / int(mask.sum())


def test_empty_mask():
    logp, logp_b, adv, _ = random_batch(5)
    mask = torch.zeros_like(logp, dtype=torch.bool)
    logp = logp.clone().requires_grad_(True)
    loss, metrics = m2po_loss(logp, logp_b, adv, mask, 0.04)
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert float(metrics["masked_fraction"]) == 0.0
    assert float(metrics["m2_before"]) == 0.0
    assert torch.count_nonzero(logp.grad) == 0
    sel = m2_select(torch.zeros(0), 0.04)
    assert sel.keep.numel() == 0 and sel.n_total == 0


def test_precomputed_keep_and_normaliser_split_into_micro_batches():
    """Micro-batches with the whole-batch keep mask and token count add up to the batch loss."""
    logp, logp_b, adv, mask = random_batch(9, b=8, scale=0.4)
    full, metrics = m2po_loss(logp, logp_b, adv, mask, 0.04)
    keep, sel = m2po_keep_mask(logp, logp_b, mask, 0.04)
    n = mask.sum()
    parts = [m2po_loss(logp[s], logp_b[s], adv[s], mask[s], 0.04, keep=keep[s], n_tokens=n,
                       selection=sel)[0] for s in (slice(0, 3), slice(3, 8))]
    assert float(sum(parts)) == pytest.approx(float(full), rel=1e-12)
    assert float(metrics["masked_fraction"]) > 0


def test_gather_flat_without_process_group_is_identity():
    x = torch.arange(5.0)
    y, offset = gather_flat(x)
    assert offset == 0 and torch.equal(x, y)


def _dist_worker(rank, world, port, chunks, threshold, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        sel = m2_select_global(chunks[rank], threshold)
        torch.save({"keep": sel.keep, "m2_before": float(sel.m2_before),
                    "m2_after": float(sel.m2_after), "n_total": sel.n_total},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_global_selection_over_ranks_equals_single_process(tmp_path):
    """Under a process group, the selection is over the concatenation of every rank's tokens."""
    import torch.multiprocessing as mp

    g = torch.Generator().manual_seed(3)
    # different lengths per rank, and rank 1 holds all the outliers: a per-rank selection differs
    chunks = [torch.rand(37, generator=g, dtype=torch.float64) * 0.05,
              torch.rand(23, generator=g, dtype=torch.float64) * 0.3]
    mp.spawn(_dist_worker, args=(2, free_port(), chunks, 0.04, str(tmp_path)), nprocs=2,
             join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    single = m2_select(torch.cat(chunks), 0.04)
    assert torch.equal(torch.cat([r["keep"] for r in results]), single.keep)
    for r in results:
        assert r["n_total"] == 60
        assert r["m2_before"] == pytest.approx(float(single.m2_before))
        assert r["m2_after"] == pytest.approx(float(single.m2_after))
    per_rank = m2_select(chunks[0], 0.04)
    assert int(per_rank.keep.sum()) != int(results[0]["keep"].sum()) or \
        int(m2_select(chunks[1], 0.04).keep.sum()) != int(results[1]["keep"].sum())


# ----------------------------------------------------------------------------- released variant


def test_harmful_variant_hand_worked_example():
    # A:       +1     +1    -1    -1    +1
    # log r:   0.5   -0.5  -0.3   0.3   0.1
    # harmful: yes    no    yes   no    yes   -> v = {0.25, 0.09, 0.01}, mean 0.1167 > 0.04
    # capped means at 0.01 / 0.09 / 0.25: 0.01, 0.0633, 0.1167 -> tau^2 = 0.01, tau = 0.1
    lr = torch.tensor([[0.5, -0.5, -0.3, 0.3, 0.1]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones_like(lr, dtype=torch.bool)
    logp_b = torch.full_like(lr, -2.0)
    logp = (logp_b + lr).requires_grad_(True)
    assert harmful_token_mask(lr, adv, mask).tolist() == [[True, False, True, False, True]]

    clip = m2_harmful_clip(logp.detach(), logp_b, adv, mask, 0.04)
    assert clip.active and clip.n_harmful == 3
    assert clip.m2_before == pytest.approx((0.25 + 0.09 + 0.01) / 3)
    assert clip.tau == pytest.approx(0.1)
    assert clip.m2_after == pytest.approx(0.01)
    assert clip.eps_low == pytest.approx(1 - math.exp(-0.1))
    assert clip.eps_high == pytest.approx(math.exp(0.1) - 1)

    loss, metrics = m2po_harmful_loss(logp, logp_b, adv, mask, 0.04)
    lo, hi = math.exp(-0.1), math.exp(0.1)
    per_token = [
        -hi,  # t0: A>0, r=e^.5 > e^.1 -> clipped to e^.1
        -math.exp(-0.5),  # t1: A>0, r<1: not harmful, unclipped
        +lo,  # t2: A<0, r=e^-.3 < e^-.1 -> clipped to e^-.1
        +math.exp(0.3),  # t3: A<0, r>1: not harmful, unclipped
        -math.exp(0.1),  # t4: at the bound itself
    ]
    assert float(loss.detach()) == pytest.approx(sum(per_token) / 5, rel=1e-9)
    loss.backward()
    g = logp.grad[0]
    assert g[0] == 0 and g[2] == 0  # harmful beyond tau: no gradient (masked)
    assert float(g[1]) == pytest.approx(-math.exp(-0.5) / 5)
    assert float(g[3]) == pytest.approx(math.exp(0.3) / 5)
    assert float(metrics["masked_fraction"]) == pytest.approx(2 / 5)
    assert float(metrics["harmful_fraction"]) == pytest.approx(3 / 5)


def test_harmful_variant_inactive_under_budget_is_plain_ratio_loss():
    logp, logp_b, adv, mask = random_batch(4, scale=0.02)
    loss, metrics = m2po_harmful_loss(logp, logp_b, adv, mask, 0.04)
    plain = -(torch.exp(logp - logp_b) * adv)[mask].sum() / mask.sum()
    assert float(loss) == pytest.approx(float(plain), rel=1e-12)
    assert float(metrics["masked_fraction"]) == 0.0


def test_harmful_variant_floors_and_solver_edges():
    assert solve_harmful_tau(torch.zeros(0), 0.04) == (float("inf"), 0.0)
    assert solve_harmful_tau(torch.tensor([0.5, 0.6]), 0.04) == (0.0, 0.0)  # all over budget
    lr = torch.tensor([[2.0, 3.0]])
    adv = torch.ones_like(lr)
    mask = torch.ones_like(lr, dtype=torch.bool)
    clip = m2_harmful_clip(lr, torch.zeros_like(lr), adv, mask, 0.04, min_eps_low=0.3,
                           min_eps_high=0.5)
    assert clip.tau == 0.0 and clip.eps_low == 0.3 and clip.eps_high == 0.5


def test_harmful_variant_reference_on_random_batches():
    """Loss value and per-token clipping against a loop implementation of the four steps."""
    for seed in range(5):
        logp, logp_b, adv, mask = random_batch(20 + seed, scale=0.4)
        lr = logp - logp_b
        v = sorted(float(lr[p]) ** 2 for p in map(tuple, mask.nonzero().tolist())
                   if (adv[p] > 0 and lr[p] > 0) or (adv[p] < 0 and lr[p] < 0))
        n = len(v)
        tau = float("inf")
        if n and sum(v) / n > 0.04:
            tau = 0.0
            for j in range(n):
                if (sum(v[: j + 1]) + v[j] * (n - j - 1)) / n <= 0.04:
                    tau = math.sqrt(v[j])
        lo, hi = (math.exp(-tau), math.exp(tau)) if tau != float("inf") else (0.0, float("inf"))
        total = 0.0
        for p in map(tuple, mask.nonzero().tolist()):
            r, a = math.exp(float(lr[p])), float(adv[p])
            total += max(-a * r, -a * min(max(r, lo), hi))
        loss, _ = m2po_harmful_loss(logp, logp_b, adv, mask, 0.04)
        assert float(loss) == pytest.approx(total / int(mask.sum()), rel=1e-9)
