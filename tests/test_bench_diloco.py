"""The DiLoCo benchmark's report (bench/diloco.py): its table from a
result, with the rows from a pretrained start kept apart from the rest
and compared with their own synchronous run. The bench itself runs real
clusters for ~14 min (`python -m bench diloco`); its figures are in
docs/benchmarks.md."""

from __future__ import annotations


def _row(steps_per_s: float, loss: float, throttled: bool) -> dict:
    one = {"steps_per_s": steps_per_s, "bytes_per_step": 1000, "final_loss": loss, "same_losses": True}
    return {"none": one, **({"1gbit": {**one, "steps_per_s": steps_per_s / 2}} if throttled else {})}


def test_rows_from_a_pretrained_start_are_compared_with_their_own_synchronous_run():
    from bench import diloco

    rows = {"synchronous": _row(20.0, 2.0, True), "diloco_h10": _row(30.0, 3.0, True),
            "synchronous_pretrained": _row(19.0, 0.8, False), "diloco_h10_pretrained": _row(25.0, 0.84, False)}
    text = diloco.table({"steps": 300, "runs": 3, "link_gbits": 1.0, "rows": rows, "png": "a.png",
                         "png_pretrained": "b.png", "plain_loops": {"sync loop": 1.5}})
    main, pretrained = text.split("from a pretrained start")
    assert "| diloco_h10 | 30.00 | 15.00 | 50.0% |" in main and "+50.0%" in main
    assert "_pretrained" not in main  # not compared with the run from scratch
    assert "| synchronous_pretrained | 19.00 | 0.8000 | +0.0% |" in pretrained
    assert "| diloco_h10_pretrained | 25.00 | 0.8400 | +5.0% |" in pretrained
    assert "b.png" in pretrained and "- sync loop: 1.5000" in pretrained
    assert set(diloco.PRETRAINED) == {"synchronous_pretrained", "diloco_h10_pretrained"}
    assert all(fields["seed"] == 1 for fields in diloco.PRETRAINED.values())  # another data order than the pretraining's
