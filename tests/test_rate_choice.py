"""Rates chosen on the selection text (utils/study/rate_choice.py), which no verdict reads."""
import pytest

from peft_pretraining.data import dataloader
from utils.study import rate_choice, records


def test_the_selection_rows_are_the_validation_rows_after_the_eval_set():
    """On the shipped corpus: the helper yields exactly validation rows first_row.. of the eval set's own order, so
    text past the eval set's rows is text the eval never reads."""
    tokenizer = dataloader.load_tokenizer("embedded")
    source = dict(dataset="embedded", dataset_path=None, tokenizer=tokenizer, max_length=32, packing=True)
    every_row = [batch["input_ids"] for batch in dataloader.iter_eval_batches(
        **source, batch_size=1, eval_tokens=31 * 40, rank=0, world_size=1)]
    chosen = [row for batch in dataloader.iter_validation_row_batches(**source, batch_size=4, first_row=30, rows=10)
              for row in batch["input_ids"]]
    assert len(chosen) == 10
    assert all((row == expected[0]).all() for row, expected in zip(chosen, every_row[30:40]))


def write_run(folder, norm, rate, seed, loss, depth=24):
    flags = ["--max_length", "128", "--lr", f"{rate:g}", "--seed", str(seed), "--norm_type", norm]
    record = dict(arm=f"L{depth}-{norm}", seed=seed, flags=flags, status="finished", last_step=2400)
    if loss is not None:
        record["selection"] = dict(first_row=rate_choice.FIRST_ROW, rows=rate_choice.ROWS, tokens=130048, loss=loss)
    records.write(folder / "runs", f"L{depth}-{norm}-seed{seed}", record)


def test_the_best_rate_is_the_lowest_mean_selection_loss_over_shared_seeds(tmp_path):
    losses = {"pre": {1e-3: 5.30, 2e-3: 5.20, 4e-3: 5.25}, "lns": {1e-3: 5.30, 2e-3: 5.20, 4e-3: 5.10}}
    folders = []
    for rate in (1e-3, 2e-3, 4e-3):
        folder = tmp_path / f"lr{rate:g}"
        folders.append(folder)
        for norm in ("pre", "lns"):
            write_run(folder, norm, rate, 1, losses[norm][rate])
            write_run(folder, norm, rate, 2, losses[norm][rate] + 0.01)
    write_run(folders[0], "pre", 1e-3, 3, 1.0)  # a seed only one rate has: not in the comparison
    chosen = rate_choice.choose(folders)
    assert chosen["pre"][24]["best"] == 2e-3 and not chosen["pre"][24]["at_edge"]
    assert chosen["lns"][24]["best"] == 4e-3 and chosen["lns"][24]["at_edge"]
    assert chosen["pre"][24]["seeds"] == [1, 2]
    assert rate_choice.main(["report", *map(str, folders), "--out", str(tmp_path / "out")]) == 0
    page = (tmp_path / "out" / "rate_choice.md").read_text()
    assert "| lns | 24 | 1, 2 |" in page and "| lr 4e-3 |" in page and "4e-3 (edge of the grid)" in page


def test_evaluate_keeps_a_measured_record_and_names_a_missing_checkpoint(tmp_path):
    write_run(tmp_path / "report", "pre", 2e-3, 1, 5.2)
    assert rate_choice.evaluate_folder(tmp_path / "report", tmp_path / "runs") == ["L24-pre-seed1: kept"]
    write_run(tmp_path / "report", "lns", 2e-3, 1, None)
    with pytest.raises(SystemExit, match="L24-lns-seed1/model_2400 is missing"):
        rate_choice.evaluate_folder(tmp_path / "report", tmp_path / "runs")


def test_folders_of_two_budgets_are_not_one_grid(tmp_path):
    write_run(tmp_path / "a", "pre", 2e-3, 1, 5.2)
    write_run(tmp_path / "b", "pre", 4e-3, 1, 5.1)
    other = records.read(records.find(tmp_path / "b" / "runs", "L24-pre-seed1"))
    other["flags"][other["flags"].index("--max_length") + 1] = "256"
    records.write(tmp_path / "b" / "runs", "L24-pre-seed1", other)
    with pytest.raises(ValueError, match="not one budget's grid"):
        rate_choice.choose([tmp_path / "a", tmp_path / "b"])


def test_evaluate_reads_only_the_arms_it_is_given(tmp_path):
    write_run(tmp_path / "report", "pre", 2e-3, 1, None)  # an older arm whose checkpoint is gone
    write_run(tmp_path / "report", "lns", 2e-3, 1, 5.0)
    assert rate_choice.evaluate_folder(tmp_path / "report", tmp_path / "runs", ["lns"]) == ["L24-lns-seed1: kept"]
