"""The documentation: the site builds with warnings as errors, the README stays short, and the
options page lists TrainConfig as config.py defines it.

`python tests/test_docs.py` remakes docs/options.md after a TrainConfig field changed.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
OPTIONS = ROOT / "docs" / "options.md"
README_WORDS = 1500


def test_the_site_builds_with_warnings_as_errors(tmp_path):
    """A broken link or anchor, a page left out of the navigation, or a docstring the API
    reference cannot render fails here (`mkdocs build --strict`)."""
    try:
        import mkdocs  # noqa: F401
        import mkdocstrings  # noqa: F401
    except ImportError as error:  # not a skip: CI must build the docs (`.ci/run` installs them)
        raise AssertionError(f"the documentation tools are not installed ({error}); "
                             "HINT: `pip install -e \".[docs]\"`") from None
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                            str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert built.returncode == 0, built.stdout + built.stderr
    reference = (site / "reference" / "api" / "index.html").read_text()
    for path in [*exported(), "gpunb.notebook.magics.GpuMagics.gputrain",
                 "gpunb.notebook.profile_magic.ProfileMagics.gpuprofile"]:
        assert f'id="{path}"' in reference, f"the API reference has no entry for {path}"


def exported() -> list[str]:
    """Where each name of `gpunb.__all__` lives (gpunb imports them on first use)."""
    import gpunb

    return [f"{gpunb._LAZY[name]}.{name}" for name in gpunb.__all__]


def test_the_api_reference_names_every_public_name_where_it_lives():
    text = (ROOT / "docs" / "reference" / "api.md").read_text()
    missing = [path for path in exported() if f"::: {path}\n" not in text]
    assert not missing, f"docs/reference/api.md lacks {missing}; HINT: add a `::: <path>` line for each"


def test_the_architecture_names_every_package_and_room():
    """Each top-level package of gpunb and each room of the runtime has its place in the map."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    package = ROOT / "gpunb"
    for folder in sorted(p for p in package.iterdir() if (p / "__init__.py").exists()):
        assert f"gpunb/{folder.name}/" in text, f"docs/architecture.md does not name gpunb/{folder.name}/"
    for room in sorted(p for p in (package / "runtime").iterdir() if (p / "__init__.py").exists()):
        assert f"runtime/{room.name}/" in text, f"docs/architecture.md does not name runtime/{room.name}/"
    assert "## Jobs (`gpunb/jobs/`)" in text


def test_the_readme_is_short_and_says_how_to_open_jupyterlab_and_find_the_sidebar():
    text = README.read_text()
    words = len(text.split())
    assert words <= README_WORDS, f"the README has {words} words (at most {README_WORDS}): move detail into docs/"
    assert "jupyter lab" in text
    assert re.search(r"sidebar is in\s+JupyterLab's\s+left\s+sidebar", text)  # where to find it
    for command in ('pip install torch==2.13.0 && pip install -e ".[test]" && gpunb demo', "bash .ci/run"):
        assert command in text  # the two set-up commands


def test_the_readme_links_to_files_that_exist():
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text()):
        if not re.match(r"[a-z]+:", target):
            assert (ROOT / target).exists(), f"README links to {target}, which is not there"


def test_the_options_page_lists_every_trainconfig_field_with_its_help():
    assert OPTIONS.read_text() == options_page(), (
        "docs/options.md differs from TrainConfig's fields; HINT: remake it with `python tests/test_docs.py`")


def options_page() -> str:
    """docs/options.md, made from TrainConfig's fields: name, flag, default and help, by section."""
    from gpunb.config import TrainConfig
    from gpunb.config_flags import config_flags

    flags = {flag.field: flag.spellings[0] for flag in config_flags()}
    lines = ["# Options", "",
             "Every option is a field of `gpunb.TrainConfig` (`Trainer(**options)`, `TrainConfig(...)`) and,",
             "where a command line can hold it, a flag of `%%gputrain`, `gpunb demo` and an exported script",
             "(`%%gputrain?` and `--help` show the same text). This page is made from `gpunb/config.py`.", ""]
    section = None
    for field in dataclasses.fields(TrainConfig):
        if field.metadata.get("section") and field.metadata["section"] != section:
            section = field.metadata["section"]
            lines += ["", f"## {section[0].upper()}{section[1:]}", "",
                      "| option | flag | default | what |", "|---|---|---|---|"]
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        flag = f"`{flags[field.name]}`" if field.name in flags else "set in Python"
        help_text = field.metadata.get("help", "").replace("|", "\\|")
        lines.append(f"| `{field.name}` | {flag} | `{default!r}` | {help_text} |")
    return "\n".join(lines).replace("\n\n\n", "\n\n") + "\n"


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    OPTIONS.write_text(options_page())
    print(f"wrote {OPTIONS}")
