"""scripts/plot_log.py on a synthetic --log-json file."""
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = str(Path(__file__).resolve().parents[3] / "scripts" / "plot_log.py")


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *map(str, args)], capture_output=True, text=True, timeout=120)


def test_plots_train_and_validation_loss(tmp_path):
    log = tmp_path / "run.json"
    with open(log, "w") as f:
        for it in range(1, 21):
            rec = {"iteration": it, "loss": 5.0 - 0.1 * it, "lr": 1e-3, "grad_norm": 1.0, "loss_scale": 1.0,
                   "skipped": it == 7, "tokens_per_s": 1000.0, "tflops_per_rank": 0.1}
            if it == 7:
                rec["loss"] = float("nan")  # an overflow step: not plotted
            if it % 10 == 0:
                rec["val_loss"] = 5.5 - 0.1 * it
            f.write(json.dumps(rec) + "\n")
    out = tmp_path / "loss.png"
    r = run(log, out)
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "train loss 4.9000 -> 3.0000 over 19 iterations" in r.stdout
    assert "validation loss 4.5000 -> 3.5000 at 2 evaluations" in r.stdout


def test_bad_logs_fail_with_a_message(tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text("\n")
    r = run(empty, tmp_path / "x.png")
    assert r.returncode != 0 and "no loss values" in r.stderr
    bad = tmp_path / "bad.json"
    bad.write_text('{"iteration": 1, "loss": 2.0}\n{oops\n')
    r = run(bad, tmp_path / "x.png")
    assert r.returncode != 0 and "line 2 is not JSON" in r.stderr
