"""report: outlier statistics show what rotation does, and every plot renders to a PNG."""

from __future__ import annotations

import json

import torch
from tiny import tiny_model

from spinquant_et.cli import main
from spinquant_et.report import outlier_ratios, rotated_copy


def test_rotation_flattens_an_outlier_channel():
    base = tiny_model("llama")
    emb = base.model.model.embed_tokens.weight
    with torch.no_grad():  # a massive-activation channel in the residual stream, as trained LLMs have
        emb[:, 7] = 120 * emb.abs().mean() * emb[:, 7].sign()
    windows = torch.randint(0, 384, (2, 32), generator=torch.Generator().manual_seed(0))
    plain = outlier_ratios(rotated_copy(base, "none"), windows)
    rotated = outlier_ratios(rotated_copy(base, "hadamard"), windows)
    assert plain["q/k/v input"][0] > 10 and plain["gate/up input"][0] > 10  # measured ~37 and ~29
    assert rotated["q/k/v input"][0] < 2 and rotated["gate/up input"][0] < 2  # measured ~1.1 and ~1.4


def test_report_writes_pngs(trained_tiny_dir, tmp_path):
    quality = {"title": "t", "fp": 10.0, "rows": ["W4A8", "W4A4KV4"], "columns": ["none", "hadamard"],
               "ppl": {"W4A8": {"none": 12.0, "hadamard": 11.0}, "W4A4KV4": {"none": 900.0, "hadamard": 20.0}}}
    (tmp_path / "q.json").write_text(json.dumps(quality))
    (tmp_path / "loss.json").write_text(json.dumps({"loss": [3.0, 2.9, 2.95, 2.7], "config": {"lr": 1.5}}))
    out = tmp_path / "img"
    assert main(["report", "--model", str(trained_tiny_dir), "--windows", "2", "--seq-len", "32",
                 "--quality", str(tmp_path / "q.json"), "--loss", str(tmp_path / "loss.json"),
                 "--out-dir", str(out)]) == 0
    for name in ("outliers.png", "quality.png", "loss.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    ratios = json.loads((out / "outliers.json").read_text())
    assert set(ratios) == {"no rotation", "random Hadamard"} and len(ratios["no rotation"]["down_proj input"]) == 2


def test_report_writes_into_the_working_directory_not_the_repository_docs(tmp_path, monkeypatch):
    """Run from the repository root, the default must not overwrite the committed docs/img plots."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "loss.json").write_text(json.dumps({"loss": [3.0, 2.9, 2.7], "config": {"lr": 1.5}}))
    assert main(["report", "--loss", "loss.json"]) == 0
    assert (tmp_path / "report" / "loss.png").is_file() and not (tmp_path / "docs").exists()
