"""utils/memory_estimate.py: the activation formula against the bytes autograd really saves (CPU, tiny config)."""
import pytest

from peft_pretraining.model.modeling_llama import build_config
from utils.memory_estimate import DTYPES, measure_saved_bytes, saved_activation_bytes


@pytest.mark.parametrize("activation_checkpointing", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_activation_formula_matches_the_saved_tensors_of_a_forward(dtype, activation_checkpointing):
    config = build_config("configs/llama_tiny.json", norm_type="pre")
    measured = measure_saved_bytes(config, dtype, 3, 24, activation_checkpointing)
    assert measured == saved_activation_bytes(config, dtype, 3, 24, activation_checkpointing)


@pytest.mark.parametrize("flags, named", [(["--batch_size", "0"], "--batch_size"), (["--seq_len", "-4"], "--seq_len"),
                                          (["--gpu_gb", "0"], "--gpu_gb"), (["--config", "{list}"], "{list}"),
                                          (["--check", "{not_json}"], "{not_json}")])
def test_bad_input_is_one_line_exit_2(flags, named, tmp_path, capsys):
    from utils.memory_estimate import main

    paths = {"list": tmp_path / "list.json", "not_json": tmp_path / "not_json.json"}
    paths["list"].write_text("[1, 2]")
    paths["not_json"].write_text("{")
    with pytest.raises(SystemExit) as exit_info:
        main([flag.format(**paths) for flag in flags])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1, err[-2000:]
    assert named.format(**paths) in err and "Traceback" not in err
