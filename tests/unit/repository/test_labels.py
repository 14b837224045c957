"""meshserve/repository/labels.py:read_labels, the one rule of which label files a model may
name (services and gateway): inside the model's folder after following links, a regular file,
bounded in size; each error names the model and the field, never a path outside the folder."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from meshserve._proto import model_config_pb2 as mc
from meshserve.repository.config import ConfigError
from meshserve.repository.labels import read_labels


def _config(label_filename: str) -> mc.ModelConfig:
    config = mc.ModelConfig(name="m")
    config.output.add(name="PLAIN")
    config.output.add(name="OUT", label_filename=label_filename)
    return config


@pytest.fixture()
def folder(tmp_path: Path) -> Path:
    (tmp_path / "outside.txt").write_text("secret\n")
    d = tmp_path / "m"
    (d / "sub").mkdir(parents=True)
    (d / "sub" / "labels.txt").write_text("a\r\nb\n")
    return d


def test_a_file_inside_the_folder_is_read_by_lines(folder: Path) -> None:
    assert read_labels(folder, _config("sub/labels.txt")) == {"OUT": ("a", "b")}
    assert read_labels(folder, _config("sub/../sub/labels.txt")) == {"OUT": ("a", "b")}
    (folder / "inner_link.txt").symlink_to(folder / "sub" / "labels.txt")  # a link that stays inside
    assert read_labels(folder, _config("inner_link.txt")) == {"OUT": ("a", "b")}
    assert read_labels(folder, mc.ModelConfig(name="m")) == {}


@pytest.mark.parametrize("name", ["../outside.txt", "sub/../../outside.txt", "/etc/passwd", "link.txt", "linkdir/x"])
def test_a_name_that_resolves_outside_the_folder_fails_the_load(folder: Path, name: str) -> None:
    (folder / "link.txt").symlink_to(folder.parent / "outside.txt")
    (folder / "linkdir").symlink_to(folder.parent)
    with pytest.raises(ConfigError) as err:
        read_labels(folder, _config(name))
    message = str(err.value)
    assert message == "model 'm': field 'output[1].label_filename': the label file is outside the model directory"
    assert str(folder.parent) not in message


def test_a_file_that_does_not_read_fails_the_load(folder: Path) -> None:
    with pytest.raises(ConfigError, match=r"^model 'm': field 'output\[1\].label_filename': cannot read label "
                                          r"file 'gone.txt': No such file or directory$"):
        read_labels(folder, _config("gone.txt"))
    with pytest.raises(ConfigError, match="label file 'sub' is not a regular file"):
        read_labels(folder, _config("sub"))
    os.mkfifo(folder / "fifo")  # (opening it would wait for a writer)
    with pytest.raises(ConfigError, match="label file 'fifo' is not a regular file"):
        read_labels(folder, _config("fifo"))


def test_a_label_file_over_the_bound_fails_the_load(folder: Path) -> None:
    (folder / "big.txt").write_bytes(b"x\n" * 8)
    assert len(read_labels(folder, _config("big.txt"), max_bytes=16)["OUT"]) == 8
    with pytest.raises(ConfigError, match=r"field 'output\[1\].label_filename': label file 'big.txt' is larger "
                                          r"than 15 bytes"):
        read_labels(folder, _config("big.txt"), max_bytes=15)
