"""The optimizer boundary's bulk gradient reads say what one-at-a-time reads say (issue 26).

Measured on 2 gloo ranks (``jobs_scripts/grad_reads_job.py``): FSDP2 keeps a no-sync
micro-step's gradient on ``_unsharded_param.grad`` in fp32 and in
``unsharded_accumulated_grad`` when the reduce dtype (fp32) differs from the parameter dtype
(bf16); a syncing backward leaves it on ``sharded_param.grad``; ``zero_grad(set_to_none=False)``
keeps zero-filled sharded gradients, ``zero_grad()`` drops them. In every one of these states
``grad_reads.sources``/``tokens`` equal the per-parameter reads the backend made before, and
where the baseline held no gradient, "written in the step" equals "holds a gradient now" (the
boundary then reads no token). The backend's reads of every unit at once equal its reads unit
by unit in each of these states, also with the parameter objects kept (what a recorder's
backend reads), and where every group's post-backward cleared its unsharded and accumulated
gradients, the tokens read from the sharded gradients alone equal the full ones.
"""

from __future__ import annotations

from pathlib import Path

from tests.jobs import REPO, assert_ok, case_result, run_ranks

SCRIPT = REPO / "tests" / "jobs_scripts" / "grad_reads_job.py"


def test_bulk_reads_equal_per_parameter_reads_in_every_gradient_state(tmp_path: Path) -> None:
    assert_ok(run_ranks([str(SCRIPT), "--out", str(tmp_path)], timeout_s=240))
    for rank in (0, 1):
        result = case_result(tmp_path, rank)
        seen = set()
        cleared = set()
        for model, points in result.items():
            for point in points:
                where = f"rank {rank}, {model}, {point['point']}"
                assert point["sources_agree"], where
                assert point["tokens_agree"], where
                assert point["bulk_sources_agree"], where
                assert point["bulk_tokens_agree"], where
                assert point["kept_sources_agree"], where
                assert point["kept_tokens_agree"], where
                assert point["kept_used"] and point["reset_forgets"], where
                assert point.get("none_kept_agrees", True), where
                cleared.add(point["groups_cleared"])
                if "written_by_token" in point:
                    assert point["written_by_token"] == point["written_by_presence"], where
                    assert any(point["written_by_token"]), where
                seen.update(point["sources"])
        # Every place a gradient can be was met, so every branch of the reads was compared.
        assert seen == {"sharded", "unsharded", "accumulated", "none"}
        # The baseline's shortcut (sharded gradients only) was compared where it applies,
        # and states where it does not were met too.
        assert cleared == {True, False}
