"""The methods of issue 20 through the command line: eata's source images (--fisher-data)
and its fallback to eta, plug-in methods (--method file.py:factory) and their trust rule,
`cafa bench --methods all`, and the forms of `cafa methods`' table."""

from __future__ import annotations

import fcntl
import io
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
from conftest import invoke
from helpers import adapt_args, bench, fails, rows
from rich.cells import cell_len
from rich.console import Console
from test_cli_adapt import setup  # noqa: F401  (the module's trained net and artifact)

from cafa_cli.jobs.bench.rows import VARIANTS, parse_methods
from cafa_cli.jobs.methods import markdown, methods_table, terminal_table
from cafa_cli.methods import REGISTRY, method_class
from cafa_cli.methods.recipes import description

NAMES = tuple(REGISTRY)

PLUGIN_GUIDE = Path(__file__).parents[1] / "docs" / "guides" / "plugins.md"


def adapt(setup, *args, quiet: bool = True):  # noqa: F811
    return invoke(*adapt_args(setup["test"], stats=setup["artifact"], batch_size=30, quiet=quiet), *args)


def warnings(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("warning:")]


@pytest.mark.parametrize("method", ["eta", "sar", "t3a", "lame", "cafa-eata", "cotta", "rotta"])
def test_each_new_method_runs_in_cafa_adapt(setup, method):
    result = adapt(setup, "--method", method)
    assert result.exit_code == 0, result.stderr
    assert len(rows(result)) == 90


def test_cotta_and_rotta_are_functions_of_the_seed(setup):  # noqa: F811
    for method in ("cotta", "rotta"):  # both draw augmentations (and cotta its restore masks) from torch's generator
        first, again = adapt(setup, "--method", method, "--seed", "3"), adapt(setup, "--method", method, "--seed", "3")
        assert first.exit_code == 0, first.stderr
        assert first.stdout == again.stdout


def test_rotta_without_batch_norm_running_statistics_is_named(setup, tmp_path):  # noqa: F811
    factory = tmp_path / "no_running.py"
    factory.write_text(
        "from torch import nn\n\n\ndef build():\n    return nn.Sequential(nn.Conv2d(1, 4, 3), "
        "nn.BatchNorm2d(4, track_running_stats=False), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))\n"
    )
    result = invoke(*adapt_args(setup["test"], model=f"{factory}:build", method="rotta", quiet=True))
    fails(result, 3, "rotta needs the running statistics of every BatchNorm", "the one at 1 keeps none")


def test_cotta_and_rotta_are_bench_rows_with_their_own_rates(setup, tmp_path):  # noqa: F811
    report = tmp_path / "r.json"
    result = bench(
        setup["test"],
        methods="tent,cotta@0.01,rotta",
        weights=setup["weights"],
        train=setup["train"],
        batch_size=30,
        workdir=tmp_path / "w",
        json=report,
    )
    assert result.exit_code == 0, result.stderr
    runs = {r["method"]: r["error"] for r in json.loads(report.read_text())["runs"]}
    assert set(runs) == {"tent", "cotta@0.01", "rotta"}


def test_eata_without_fisher_data_says_so_in_one_line_and_runs_as_eta(setup):
    eata, eta = adapt(setup, "--method", "eata", quiet=False), adapt(setup, "--method", "eta")
    assert eata.exit_code == eta.exit_code == 0, eata.stderr
    said = [w for w in warnings(eata) if "eata" in w]
    assert len(said) == 1 and "runs as eta" in said[0] and "--source-data" in said[0]
    assert eata.stdout == eta.stdout


def test_eata_with_fisher_data_adds_its_fisher_term(setup):
    result = adapt(
        setup,
        "--method",
        "eata",
        "--fisher-data",
        setup["train"],
        "--fisher-samples",
        "60",
        "--lr",
        "0.05",
        quiet=False,
    )
    assert result.exit_code == 0, result.stderr
    assert not [w for w in warnings(result) if "eata" in w]
    assert len(rows(result)) == 90
    # --source-data is the option's name for every method's source images; --fisher-data another
    named = adapt(setup, "--method", "eata", "--source-data", setup["train"], "--fisher-samples", "60", "--lr", "0.05")
    assert named.exit_code == 0 and named.stdout == result.stdout, named.stderr


def test_fisher_samples_below_one_is_a_usage_error(setup):
    fails(
        adapt(setup, "--method", "eata", "--fisher-data", setup["train"], "--fisher-samples", "0"),
        2,
        "--fisher-samples",
    )


def test_fisher_data_that_is_not_there_is_an_input_error(setup, tmp_path):
    fails(adapt(setup, "--method", "eata", "--fisher-data", tmp_path / "nowhere"), 3, "nowhere")


def plugin_file(tmp_path: Path) -> Path:
    """The plug-in of docs/guides/plugins.md, as a file."""
    block = next(
        b
        for b in re.findall(r"```python\n(.*?)```", PLUGIN_GUIDE.read_text(), flags=re.S)
        if b.startswith("# my_method.py")
    )
    path = tmp_path / "my_method.py"
    path.write_text(block)
    return path


def test_the_documented_plugin_runs_through_cafa_adapt(setup, tmp_path):
    result = adapt(setup, "--method", f"{plugin_file(tmp_path)}:build")
    assert result.exit_code == 0, result.stderr
    assert len(rows(result)) == 90


def test_a_plugins_declared_option_is_set_and_checked_from_the_command_line(setup, tmp_path):
    plugin = f"{plugin_file(tmp_path)}:build"
    never = adapt(setup, "--method", plugin, "--method-option", "threshold=1.0")  # no sample is that confident: no step
    assert never.exit_code == 0, never.stderr
    assert rows(never) == rows(adapt(setup, "--method", "bn"))
    assert rows(adapt(setup, "--method", plugin)) != rows(never)
    fails(
        adapt(setup, "--method", plugin, "--method-option", "threshold=2"),
        2,
        "option threshold must be a number in [0, 1]",
    )
    fails(
        adapt(setup, "--method", plugin, "--method-option", "margin=2"),
        2,
        "has no option margin (its options: threshold)",
    )


def test_a_plugin_is_a_bench_row_that_runs_as_in_cafa_adapt(setup, tmp_path):  # noqa: F811
    plugin = f"{plugin_file(tmp_path)}:build"
    common = dict(weights=setup["weights"], batch_size=30)
    report, metrics = tmp_path / "r.json", tmp_path / "m.json"
    result = bench(
        setup["test"],
        methods=f"tent,{plugin}@0.01",
        **common,
        fraction=1,
        train=setup["train"],
        workdir=tmp_path / "w",
        json=report,
    )
    assert result.exit_code == 0, result.stderr
    runs = {r["method"]: r["error"] for r in json.loads(report.read_text())["runs"]}
    alone = invoke(*adapt_args(setup["test"], method=plugin, lr=0.01, **common, metrics_json=metrics))
    assert alone.exit_code == 0, alone.stderr
    assert runs[f"{plugin}@0.01"] == pytest.approx(json.loads(metrics.read_text())["domains"][0]["error"])


def test_a_plugin_that_returns_no_method_is_named(setup, tmp_path):
    path = tmp_path / "bad.py"
    path.write_text("def build(gaussians, device):\n    return 42\n")
    fails(adapt(setup, "--method", f"{path}:build"), 3, "--method", "returned int, not a Method")


def test_a_plugin_file_that_is_not_there_is_named(setup, tmp_path):
    fails(adapt(setup, "--method", f"{tmp_path / 'none.py'}:build"), 3, "no such file")


def test_a_config_file_may_name_a_method_but_not_a_plugin(tmp_path):
    from cafa_cli.cli.app import command_options
    from cafa_cli.cli.defaults import read_defaults
    from cafa_cli.core.errors import UsageError

    (tmp_path / "cafa.toml").write_text(f'[adapt]\nmethod = "{plugin_file(tmp_path)}:build"\n')
    with pytest.raises(UsageError, match="names code to run.*on the command line"):
        read_defaults(tmp_path, command_options())
    (tmp_path / "cafa.toml").write_text(f'[bench]\nmethods = "tent,{plugin_file(tmp_path)}:build"\n')
    with pytest.raises(UsageError, match="names code to run.*on the command line"):
        read_defaults(tmp_path, command_options())
    (tmp_path / "cafa.toml").write_text('[adapt]\nmethod = "tent"\n')
    assert read_defaults(tmp_path, command_options()) == {"adapt": {"method": "tent"}}


def test_bench_methods_all_is_every_method_and_variant_but_the_clip_methods():
    labels = [row.label for row in parse_methods("all")]
    assert labels == [name for name in NAMES if method_class(name).on_any_classifier()] + list(VARIANTS)
    assert "tda" not in labels and [row.label for row in parse_methods("all,tda")][-1] == "tda"
    assert {"eata", "eta", "sar", "t3a", "lame", "cafa-eata", "cotta", "rotta"} <= set(labels)
    mixed = [row.label for row in parse_methods("tent@0.01,all")]
    assert mixed[0] == "tent@0.01" and "tent" not in mixed and len(mixed) == len(labels)


# --- cafa methods: a table for a terminal, markdown for a pipe, JSON on request -------


def on_a_terminal(*args: str, columns: int) -> str:
    """`cafa ARGS` with stdin and stdout on a pseudo-terminal `columns` wide (rich reads the
    width off the first standard stream that is a terminal), its output without colours."""
    master, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    env = {key: value for key, value in os.environ.items() if key not in ("COLUMNS", "LINES")}
    with subprocess.Popen(
        [sys.executable, "-m", "cafa_cli", *args], stdin=terminal, stdout=terminal, env=env
    ) as process:
        os.close(terminal)
        written = b""
        try:
            while chunk := os.read(master, 1 << 16):
                written += chunk
        except OSError:  # EIO: the command closed its side
            pass
        os.close(master)
    assert process.returncode == 0
    return re.sub(r"\x1b\[[0-9;]*m", "", written.decode()).replace("\r\n", "\n")


def test_methods_on_a_terminal_is_a_table_that_fits_it():
    shown = on_a_terminal("methods", columns=72)
    lines = shown.splitlines()
    assert "| method |" not in shown and "|---|" not in shown  # drawn, not markdown
    assert max(map(cell_len, lines)) <= 72
    assert [line.split()[0] for line in lines if line.split() and line.split()[0] in NAMES] == list(NAMES)


@pytest.mark.parametrize("width", [40, 72, 100, 160])
def test_the_terminal_table_wraps_inside_its_cells_to_the_width(width):
    out = io.StringIO()
    Console(file=out, width=width).print(terminal_table(methods_table(), width))
    lines = out.getvalue().splitlines()
    assert max(map(cell_len, lines)) <= width
    assert [line.split()[0] for line in lines if line.split() and line.split()[0] in NAMES] == list(
        NAMES
    )  # names whole
    assert {"yes", "no", "1.00", "paper", "adapts", "artifact", "TENT"} <= set(re.findall(r"[\w.]+", out.getvalue()))


def test_methods_into_a_pipe_is_todays_markdown_and_format_chooses(monkeypatch):
    piped = invoke("methods")  # the runner's stdout is no terminal
    assert piped.exit_code == 0, piped.stderr
    assert piped.stdout == markdown(methods_table()) + "\n"
    header = "| method | summary | paper | adapts | artifact | step ÷ TENT (CPU) | peak MiB (CPU) |\n|---|"
    assert piped.stdout.startswith(header)
    assert invoke("methods", "--format", "markdown").stdout == piped.stdout
    monkeypatch.setenv("COLUMNS", "64")  # the width rich takes where stdout is no terminal
    table = invoke("methods", "--format", "table")
    assert table.exit_code == 0, table.stderr
    assert "| method |" not in table.stdout and max(map(cell_len, table.stdout.splitlines())) <= 64


def test_methods_format_json_is_json():
    as_json, format_json = invoke("methods", "--json"), invoke("methods", "--format", "json")
    assert as_json.exit_code == format_json.exit_code == 0, as_json.stderr + format_json.stderr
    assert format_json.stdout == as_json.stdout
    assert json.loads(as_json.stdout) == methods_table()
    fails(invoke("methods", "--json", "--format", "markdown"), 2, "--json is --format json")
    for flag in (["--json"], ["--format", "json"]):  # one method's recipe is TOML: not silently what was asked
        fails(invoke("methods", "eata", *flag), 2, f"{flag[0]} is for the table of methods", "as TOML")


def test_peak_memory_is_shown_beside_the_cost_in_every_form():
    listed = {row["method"]: row for row in json.loads(invoke("methods", "--json").stdout)}
    assert list(listed["tent"]) == ["method", "summary", "paper", "adapts", "artifact", "cost", "memory_mib"]
    assert listed["tent"]["memory_mib"] > listed["source"]["memory_mib"]  # a backward pass keeps activations
    out = io.StringIO()
    Console(file=out, width=160).print(terminal_table(methods_table(), 160))
    assert "peak MiB" in out.getvalue() and "above the loaded model" in out.getvalue()
    out = io.StringIO()
    Console(file=out, width=40).print(terminal_table(methods_table(), 40))  # stacked: each fact named
    words = " ".join(re.sub(r"[│┃─┼━╇]", " ", out.getvalue()).split())
    assert re.search(r"source the source model .* peak MiB \(CPU\): \d+ bn ", words)


def test_every_method_has_a_memory_figure_or_an_explicit_dash():
    """Not silently missing: a new method's recipe file names its figure (benchmarks/method_memory.py
    measures every registered method) or says "—" (its notes then say why)."""
    figures = {name: description(name)["memory_mib"] for name in NAMES}
    wrong = {name: value for name, value in figures.items() if not (value == "—" or type(value) is int and value >= 0)}
    assert not wrong, f"memory_mib must be whole MiB or '—' in recipes/NAME.toml's [method] table: {wrong}"
    shown = {row["method"]: row["memory_mib"] for row in methods_table()}  # "—" is None, shown as —
    assert shown == {name: None if value == "—" else value for name, value in figures.items()}


def test_methods_usage_shows_its_optional_method_once_bracketed():
    usage = invoke("methods", "--help").stdout.splitlines()[0]
    assert usage.endswith("methods [OPTIONS] [METHOD]"), usage
