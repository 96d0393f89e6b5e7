"""`o3edge build` and `o3edge inspect` as a user runs them."""

import json
import os

from o3edge.build_cli import main
from tests.helpers import AUTO_CPU_DTYPE


def manifest(path):
    with open(os.path.join(path, "manifest.json")) as fh:
        return json.load(fh)


def test_build_shows_progress_per_layer_and_writes_an_int4_engine(tiny_dir, tmp_path, capsys):
    out = str(tmp_path / "engine")
    assert main(["build", tiny_dir, out, "--group-size", "64"]) == 0
    printed = capsys.readouterr().out
    for i in range(4):
        assert f"layer {i} done" in printed
    assert "bfloat16 + INT4 FFN (group 64)" in printed and "8 INT4 modules" in printed
    raw = manifest(out)
    assert raw["quantization"]["group_size"] == 64 and raw["dtype"] == "bfloat16"
    assert raw["precision_report"] is None


def test_build_without_int4(tiny_dir, tmp_path):
    out = str(tmp_path / "engine")
    assert main(["build", tiny_dir, out, "--no-int4-ffn", "--dtype", "float32"]) == 0
    raw = manifest(out)
    assert raw["quantization"] is None and raw["dtype"] == "float32"


def test_check_prints_the_report_and_stores_it(tiny_dir, tmp_path, capsys):
    out = str(tmp_path / "engine")
    assert main(["build", tiny_dir, out, "--check", "--check-tokens", "4"]) == 0
    printed = capsys.readouterr().out
    assert "top-1 agreement" in printed and "relative error" in printed
    assert f"{AUTO_CPU_DTYPE} + int4 g128" in printed  # the check runs the engine as it runs here
    report = manifest(out)["precision_report"]
    assert report["num_new_tokens"] == 4 and report["device"] == "cpu"
    assert 0 < report["relative_error"] < 1 and 0 <= report["top1_agreement"] <= 1
    assert main(["inspect", out]) == 0
    shown = capsys.readouterr().out
    assert "INT4 group 128" in shown and "top-1 agreement" in shown


def test_errors_are_one_line_and_exit_2(tiny_dir, tmp_path, capsys):
    out = str(tmp_path / "engine")
    os.makedirs(out)
    open(os.path.join(out, "something"), "w").close()
    assert main(["build", tiny_dir, out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "--force" in err and err.count("\n") == 1
    assert main(["build", str(tmp_path / "nowhere"), str(tmp_path / "x")]) == 2
    assert "config.json not found" in capsys.readouterr().err
    assert main(["inspect", tiny_dir]) == 2  # a checkpoint, not an engine


def test_int4_all_preset_calibrates_on_the_users_text(tiny_dir, tmp_path, capsys):
    text = tmp_path / "calibration.txt"
    text.write_text("def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n    return a + b\n\n" * 400)
    out = str(tmp_path / "engine")
    assert main(["build", tiny_dir, out, "--preset", "cpu-int4-all", "--calibration-text", str(text),
                 "--calibration-tokens", "1024"]) == 0
    assert "calibrating on 1,024 tokens" in capsys.readouterr().out
    int4 = manifest(out)["quantization"]["int4"]
    assert int4["method"] == "gptq-mse" and "lm_head" in int4["modules"]
    assert int4["calibration"] == {"text": "user-supplied", "window": 512, "tokens": 1024}
    assert main(["inspect", out]) == 0
    assert "17 modules, gptq-mse (preset cpu-int4-all)" in capsys.readouterr().out


def test_calibration_text_too_short_is_refused(tiny_dir, tmp_path, capsys):
    text = tmp_path / "calibration.txt"
    text.write_text("too short")
    assert main(["build", tiny_dir, str(tmp_path / "engine"), "--preset", "cpu-int4-all",
                 "--calibration-text", str(text)]) == 2
    assert "calibration text too short" in capsys.readouterr().err
