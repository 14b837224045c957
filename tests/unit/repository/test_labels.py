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
    # (Triton's std::getline: split on "\n" only, so a "\r" stays in its label)
    assert read_labels(folder, _config("sub/labels.txt")) == {"OUT": ("a\r", "b")}
    assert read_labels(folder, _config("sub/../sub/labels.txt")) == {"OUT": ("a\r", "b")}
    (folder / "inner_link.txt").symlink_to(folder / "sub" / "labels.txt")  # a link that stays inside
    assert read_labels(folder, _config("inner_link.txt")) == {"OUT": ("a\r", "b")}
    (folder / "inner_dir").symlink_to(folder / "sub")
    assert read_labels(folder, _config("inner_dir/labels.txt")) == {"OUT": ("a\r", "b")}
    assert read_labels(folder, mc.ModelConfig(name="m")) == {}


@pytest.mark.parametrize(("text", "labels"), [
    ("", ()),
    ("\n", ("",)),
    ("a", ("a",)),
    ("a\n\nb\n", ("a", "", "b")),
    ("a\n\n", ("a", "")),
    # every other line break str.splitlines knows stays inside its label: the classes after it keep
    # their own labels, as in Triton
    ("v\x0bt\nf\x0cf\nf\x1cg\x1dr\x1e\nn\x85l\nl\u2028s\u2029p\nc\rr\nlast", (
        "v\x0bt", "f\x0cf", "f\x1cg\x1dr\x1e", "n\x85l", "l\u2028s\u2029p", "c\rr", "last")),
])
def test_lines_are_split_on_newline_only_as_triton_reads_them(folder: Path, text: str,
                                                                labels: tuple[str, ...]) -> None:
    (folder / "l.txt").write_bytes(text.encode())
    assert read_labels(folder, _config("l.txt")) == {"OUT": labels}


@pytest.mark.parametrize("swapped", ["file", "folder"])
def test_a_link_swapped_in_after_the_check_is_not_followed(folder: Path, swapped: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The path is checked once resolved, then opened: a link put in its place between the two
    (here: resolve() made to see no links, as if the swap came right after it) fails the load
    instead of reading the file it points to."""
    if swapped == "file":
        (folder / "labels.txt").symlink_to(folder.parent / "outside.txt")
        name = "labels.txt"
    else:
        (folder / "dir").symlink_to(folder.parent)
        name = "dir/outside.txt"
    monkeypatch.setattr(Path, "resolve", lambda self, strict=False: Path(os.path.abspath(self)))
    with pytest.raises(ConfigError) as err:
        read_labels(folder, _config(name))
    assert str(err.value) == (f"model 'm': field 'output[1].label_filename': label file '{name}' became a link "
                              "after it was checked")


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
