"""The shell commands in README.md and docs/*.md still work.

What counts as a command:
- every line of a fenced block labelled ``bash`` (a line ending in ``\\`` continues on the next; blank lines and
  whole-line comments are skipped). A fenced block labelled ``sh``, ``shell``, ``console`` or with no label fails
  the test: commands are labelled ``bash``, everything else by its language (``yaml``, ``text``);
- every inline code span that starts with ``python3 agora_cli.py`` or ``agora`` followed by a space or the end of
  the span (placeholders such as ``FILE`` and ``[--dtype fp32|bf16]`` are allowed there).

Markers: a bash line may end in a comment that says why this test cannot run it, or what exit it gives:
- ``# needs: gpu`` / ``root`` / ``network`` / ``swarm`` (a running swarm, or a store one wrote), comma-separated;
- ``# runs until Ctrl-C``: a role or app that runs until stopped;
- ``# takes minutes``: the test suite, a long job;
- ``# exits N``: run it, and expect exit code N instead of 0.
A line with ``sudo`` must say ``needs: root``.

What is checked:
- an unmarked bash line (or one marked only ``# exits N``) must be one agora command (``python3 agora_cli.py ...``
  or ``agora ...``, no pipes or ``&&``); it is run for real, in a scratch directory that links to the
  repository's top-level entries, with HOME and XDG_CONFIG_HOME in that directory, HF_HUB_OFFLINE=1 and no
  HF_TOKEN, and must exit 0 (or N);
- every other agora command (marked lines, each agora part of a ``&&`` / ``|`` chain, inline spans) must still
  exist: ``<its subcommands> --help`` exits 0 and names every ``--flag`` the command uses;
- a marked line's other programs are not run, but a repository file it names (``*.py``, ``*.txt``, ``*.yaml``,
  ``*.service``, a relative path) must exist, as must the module of ``python3 -m MODULE``;
- every relative link of these files points to a file or folder of the repository.

All the agora commands run in one helper process, one after another, through ``agora_cli.main`` (the same code
``python3 agora_cli.py`` runs, with torch and hivemind imported once instead of once per command), so the test
stays within about a minute on two busy cores; one real ``python3 agora_cli.py --help`` checks the script itself.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REASONS = {"gpu", "root", "network", "swarm"}
RUNNER_TIMEOUT_S = 300  # a bound for a stuck command, not a speed target

FENCE = re.compile(r"^```(\S*)\s*$")
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
AGORA_START = re.compile(r"^(python3 agora_cli\.py|agora)(\s|$)")
NEEDS = re.compile(r"needs:\s*([a-z, -]+?)(?:;|$|\s{2}|\s-\s|\()")
EXITS = re.compile(r"\bexits (\d+)\b")
LINK = re.compile(r"\]\(([^)\s]+)\)")
FLAG = re.compile(r"^--[A-Za-z0-9][A-Za-z0-9-]*")
SUBCOMMAND_WORD = re.compile(r"^[a-z][a-z0-9-]*$")
REPO_FILE = re.compile(r"^[A-Za-z0-9_.@-][A-Za-z0-9_./@-]*\.(py|txt|yaml|yml|service|toml)$")


@dataclass
class Command:
    doc: str
    line: int
    text: str  # the command without its trailing comment
    comment: str = ""
    inline: bool = False
    reasons: set[str] = field(default_factory=set)
    until_ctrl_c: bool = False
    takes_minutes: bool = False
    exit_code: int = 0

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}: {self.text}"

    @property
    def runnable(self) -> bool:
        return not (self.inline or self.reasons or self.until_ctrl_c or self.takes_minutes)


def split_comment(line: str) -> tuple[str, str]:
    """The command and its trailing comment: the first ``#`` outside quotes that starts a word."""
    quote = None
    for index, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1].isspace()):
            return line[:index].rstrip(), line[index + 1 :].strip()
    return line.rstrip(), ""


def parse_markers(command: Command) -> None:
    comment = command.comment
    needs = NEEDS.search(comment)
    if needs:
        command.reasons = {word.strip() for word in needs.group(1).split(",") if word.strip()}
    command.until_ctrl_c = "runs until Ctrl-C" in comment
    command.takes_minutes = "takes minutes" in comment
    exits = EXITS.search(comment)
    command.exit_code = int(exits.group(1)) if exits else 0


def bash_commands(doc: str, lines: list[str], problems: list[str]) -> list[Command]:
    found, label, pending, start = [], None, "", 0
    for number, line in enumerate(lines, 1):
        fence = FENCE.match(line.strip())
        if fence:
            if label is None:
                label = fence.group(1)
                if label in ("", "sh", "shell", "console"):
                    problems.append(f"{doc}:{number}: label this fenced block (bash for commands, else its language)")
            else:
                label = None
            continue
        if label != "bash" or (not pending and (not line.strip() or line.lstrip().startswith("#"))):
            continue
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        text, comment = split_comment(pending + line)
        pending = ""
        command = Command(doc, start, text.strip(), comment)
        parse_markers(command)
        found.append(command)
    return found


def inline_commands(doc: str, lines: list[str]) -> list[Command]:
    found, fenced = [], False
    for number, line in enumerate(lines, 1):
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if fenced:
            continue
        for span in INLINE.findall(line):
            if AGORA_START.match(span.strip()):
                found.append(Command(doc, number, span.strip(), inline=True))
    return found


def collect() -> tuple[list[Command], list[str]]:
    commands, problems = [], []
    for path in DOCS:
        lines = path.read_text().splitlines()
        name = str(path.relative_to(ROOT))
        commands += bash_commands(name, lines, problems)
        commands += inline_commands(name, lines)
    return commands, problems


def tokens(text: str) -> list[str]:
    """Shell words; placeholders' brackets and a Markdown table's escaped pipe are dropped first."""
    cleaned = text.replace("\\|", "|").replace("[", " ").replace("]", " ").replace("...", " ")
    try:
        return shlex.split(cleaned)
    except ValueError:
        return cleaned.split()


def chain_parts(text: str) -> list[list[str]]:
    """The simple commands of a ``a && b | c ; d`` line, each as its words."""
    parts, current = [], []
    for word in tokens(text):
        if word in ("&&", "||", "|", ";"):
            parts.append(current)
            current = []
        else:
            current.append(word)
    return [*parts, current]


def agora_argv(words: list[str]) -> list[str] | None:
    """The arguments after the entry point, if ``words`` (past sudo and VAR=value) is an agora command."""
    while words and (words[0] == "sudo" or re.match(r"^[A-Z_][A-Z0-9_]*=", words[0])):
        words = words[1:]
    if words[:2] == ["python3", "agora_cli.py"]:
        return words[2:]
    if words[:1] == ["agora"]:
        return words[1:]
    return None


def subcommand_path(argv: list[str]) -> list[str]:
    path = []
    for word in argv:
        if not SUBCOMMAND_WORD.match(word):
            break
        path.append(word)
    return path


def used_flags(argv: list[str]) -> set[str]:
    return {FLAG.match(word).group(0) for word in argv if FLAG.match(word)}


RUNNER = r"""
import contextlib, io, json, os, sys, traceback
jobs = json.load(open(sys.argv[1]))
sys.path.insert(0, jobs["root"])
os.chdir(jobs["cwd"])
import agora_cli
results = []
for argv in jobs["argvs"]:
    with open(jobs["progress"], "w") as progress:
        progress.write(json.dumps(argv))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = agora_cli.main(list(argv))
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except Exception:
            code = "exception"
            err.write(traceback.format_exc())
    results.append({"argv": argv, "code": code, "out": out.getvalue(), "err": err.getvalue()[-2000:]})
    with open(jobs["results"], "w") as handle:
        json.dump(results, handle)
"""


def run_in_one_process(argvs: list[list[str]], scratch: Path) -> dict[str, dict]:
    """Run each argv through agora_cli.main in one helper process; results by the argv's JSON."""
    work = scratch / "work"
    work.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in (".git",):
            (work / entry.name).symlink_to(entry)
    jobs = {
        "root": str(ROOT),
        "cwd": str(work),
        "argvs": argvs,
        "progress": str(scratch / "progress.json"),
        "results": str(scratch / "results.json"),
    }
    (scratch / "jobs.json").write_text(json.dumps(jobs))
    env = {key: value for key, value in os.environ.items() if key not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    env.update(HOME=str(scratch / "home"), XDG_CONFIG_HOME=str(scratch / "home" / ".config"), HF_HUB_OFFLINE="1")
    env.update(PYTHONPATH=str(ROOT))
    try:
        subprocess.run(
            [sys.executable, "-c", RUNNER, str(scratch / "jobs.json")],
            cwd=work,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=RUNNER_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        pass  # the commands that finished are in results.json; the one that hung is in progress.json
    results_file = scratch / "results.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else []
    by_argv = {json.dumps(result["argv"]): result for result in results}
    if len(by_argv) < len({json.dumps(argv) for argv in argvs}):
        stuck = (scratch / "progress.json").read_text() if (scratch / "progress.json").exists() else "?"
        pytest.fail(f"the helper process stopped (or ran past {RUNNER_TIMEOUT_S} s) while running agora {stuck}")
    return by_argv


def marker_problems(command: Command) -> list[str]:
    problems = [f"{command.where}: unknown reason(s) {sorted(command.reasons - REASONS)}"] * bool(
        command.reasons - REASONS
    )
    if "sudo" in tokens(command.text) and "root" not in command.reasons:
        problems.append(f"{command.where}: uses sudo, so it must say `# needs: root`")
    return problems


def other_program_problems(command: Command, words: list[str]) -> list[str]:
    problems = []
    for word in words:
        if REPO_FILE.match(word) and not word.startswith("/") and not (ROOT / word).exists():
            problems.append(f"{command.where}: names {word}, which the repository does not hold")
    if words[:2] == ["python3", "-m"] and len(words) > 2 and importlib.util.find_spec(words[2]) is None:
        problems.append(f"{command.where}: python module {words[2]} is not installed")
    return problems


def link_problems() -> list[str]:
    problems = []
    for path in DOCS:
        for target in LINK.findall(path.read_text()):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            file_part = urllib.parse.unquote(target.split("#", 1)[0])
            if file_part and not (path.parent / file_part).exists():
                problems.append(f"{path.relative_to(ROOT)}: link to {target}, which does not exist")
    return problems


def plan(commands: list[Command]) -> tuple[list[tuple[Command, list[str]]], list[tuple[Command, list[str]]], list[str]]:
    """What to run for real, what to check by --help, and the problems found without running anything."""
    runs, helps, problems = [], [], []
    for command in commands:
        problems += marker_problems(command)
        parts = chain_parts(command.text)
        if command.runnable:
            argv = agora_argv(parts[0]) if len(parts) == 1 else None
            if argv is None:
                problems.append(f"{command.where}: not one agora command: mark why it cannot run here")
            else:
                runs.append((command, argv))
            continue
        for words in parts:
            argv = agora_argv(words)
            if argv is None:
                problems += other_program_problems(command, words)
            else:
                helps.append((command, argv))
    return runs, helps, problems


def test_docs_exist_and_hold_commands():
    commands, _ = collect()
    assert (ROOT / "docs").is_dir() and len(DOCS) >= 5, "README.md and docs/*.md"
    assert sum(command.runnable for command in commands) >= 5, "the docs lost their runnable commands"


def test_every_command_in_the_docs_runs_or_exists(tmp_path):
    commands, problems = collect()
    runs, helps, found = plan(commands)
    problems += found + link_problems()
    help_argvs = {json.dumps([*subcommand_path(argv), "--help"]) for _, argv in helps}
    argvs = [argv for _, argv in runs] + [json.loads(argv) for argv in sorted(help_argvs)]
    results = run_in_one_process(argvs, tmp_path)
    for command, argv in runs:
        result = results[json.dumps(argv)]
        if result["code"] != command.exit_code:
            problems.append(f"{command.where}: exit {result['code']}, expected {command.exit_code}: {result['err']}")
    for command, argv in helps:
        result = results[json.dumps([*subcommand_path(argv), "--help"])]
        if result["code"] != 0:
            problems.append(f"{command.where}: `{' '.join(subcommand_path(argv))} --help` failed: {result['err']}")
            continue
        for flag in sorted(used_flags(argv)):
            if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", result["out"]):
                problems.append(f"{command.where}: {flag} is not an option of `{' '.join(subcommand_path(argv))}`")
    assert not problems, "\n".join(problems)


def test_the_entry_script_itself_answers_help():
    done = subprocess.run(
        [sys.executable, "agora_cli.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "demo" in done.stdout and "--swarm" in done.stdout


def test_a_command_the_cli_does_not_know_fails_the_check(tmp_path):
    """The check is not vacuous: an unknown subcommand and an unknown flag are both caught."""
    doc = [
        "```bash",
        "python3 agora_cli.py frobnicate --help",
        "python3 agora_cli.py describe --bogus-flag  # needs: gpu",
        "```",
    ]
    commands = bash_commands("fake.md", doc, [])
    runs, helps, problems = plan(commands)
    assert not problems and len(runs) == 1 and len(helps) == 1
    results = run_in_one_process([runs[0][1], ["describe", "--help"]], tmp_path)
    assert results[json.dumps(runs[0][1])]["code"] != 0
    assert "--bogus-flag" not in results[json.dumps(["describe", "--help"])]["out"]
