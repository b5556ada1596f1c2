"""``graphkern bench --model PATH``: stock against patched generation of a checkpoint, measured
with mlx-lm's own loop and printed as ``mlx_lm.generate --verbose`` prints its figures.

Each run's line is printed as the run ends; after the warm-up and again after the first round,
a line on stderr says about how long the rest will take. On a terminal a progress bar (tokens
generated, time left) stands below the lines.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from typing import Any

import click

from graphkern.cli.commands import progress_steps
from graphkern.cli.errors import BadInput
from graphkern.cli.model import DEFAULT_PROMPT, load_checkpoint, patched_line

__all__ = ["DEFAULT_ROUNDS", "DEFAULT_SECONDS", "bench_cmd", "duration", "register"]

#: Rounds by default: with ``--max-tokens`` chosen to fit :data:`DEFAULT_SECONDS`, about a
#: minute in all, for a 1B 4-bit model on a laptop's CPU as on a GPU.
DEFAULT_ROUNDS = 2
#: What the whole measurement should take when ``--max-tokens`` is not given.
DEFAULT_SECONDS = 60.0


def duration(seconds: float) -> str:
    """``45 s``, ``3 min 10 s``, ``1 h 5 min``: a rough time for a person to read.

    >>> duration(0.01), duration(4.26), duration(42.4), duration(190), duration(3900)
    ('under 0.1 s', '4.3 s', '42 s', '3 min 10 s', '1 h 5 min')
    """
    if seconds < 0.05:
        return "under 0.1 s"
    if seconds < 9.95:
        return f"{seconds:.1f} s"
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        minutes, rest = divmod(seconds, 60)
        return f"{minutes} min" + (f" {rest} s" if rest else "")
    hours, rest = divmod(seconds, 3600)
    return f"{hours} h" + (f" {rest // 60} min" if rest >= 60 else "")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


class _Report:
    """Prints each run's line as it ends and the estimates of the time left; on a terminal also
    a progress bar of the tokens generated. ``line`` prints results (stdout), ``note`` progress
    (stderr); on a terminal both go above the bar."""

    def __init__(self, rounds: int, quiet: bool, bar: Any = None, task: Any = None):
        self.rounds, self.quiet, self.bar, self.task = rounds, quiet, bar, task
        self.max_tokens = 0
        self.round_started = time.perf_counter()

    def line(self, text: str) -> None:
        if self.quiet:
            return
        if self.bar is not None and sys.stdout.isatty():
            self.bar.console.print(text, highlight=False, markup=False, soft_wrap=True)
        else:
            click.echo(text)

    def note(self, text: str) -> None:
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.console.print(text, highlight=False, markup=False, soft_wrap=True)
        else:
            click.echo(text, err=True)

    def describe(self, text: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=text)

    def token(self) -> None:
        if self.bar is not None:
            self.bar.advance(self.task)

    def planned(self, plan: Any) -> None:
        self.max_tokens = plan.max_tokens
        self.round_started = time.perf_counter()
        if self.bar is not None:  # the bar counts the rounds' tokens from here
            self.bar.reset(self.task, total=2 * plan.rounds * plan.max_tokens)
        seconds = plan.warmup_seconds
        self.note(f"warm-up: stock {duration(seconds['stock'])}, patched {duration(seconds['patched'])}; "
                  f"{_plural(plan.rounds, 'round')} of {plan.max_tokens} tokens a run should take about "
                  f"{duration(plan.estimate)}")

    def run_done(self, done: Any) -> None:
        if done.round == 0:
            return
        self.line(f"round {done.round}  {done.side:<7}  {done.run.verbose_line()}")
        if done.side == "patched":
            took = time.perf_counter() - self.round_started
            self.round_started = time.perf_counter()
            left = self.rounds - done.round
            if done.round == 1 and left:
                self.note(f"round 1 took {duration(took)}; {_plural(left, 'more round')}: about "
                          f"{duration(took * left)} to go")


@contextlib.contextmanager
def _report(rounds: int, quiet: bool) -> Iterator[_Report]:
    """A :class:`_Report`, with a rich progress bar on stderr when it is a terminal."""
    from rich.console import Console

    console = Console(stderr=True)
    if quiet or not console.is_terminal:
        yield _Report(rounds, quiet)
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("tokens,"), TimeRemainingColumn(), TextColumn("left"), console=console,
                  transient=True, redirect_stdout=False, redirect_stderr=False) as bar:
        task = bar.add_task("warm-up", total=None)
        yield _Report(rounds, quiet, bar, task)


@click.command("bench")
@click.option("--model", "model_path", metavar="PATH", required=True,
              help="An mlx-lm checkpoint folder (or a Hugging Face Hub id), loaded with mlx_lm.load.")
@click.option("--prompt", metavar="TEXT", default=None,
              help=f"The prompt, through the model's chat template (default {DEFAULT_PROMPT!r}).")
@click.option("--max-tokens", "-m", default=None, type=click.IntRange(min=1),
              help="Tokens to generate each run (the end of sequence is ignored). Default: as many "
                   "as let the whole measurement take about a minute, from 8 to 128.")
@click.option("--rounds", "-n", default=DEFAULT_ROUNDS, show_default=True, type=click.IntRange(min=1),
              help="Rounds, after one short warm-up run each; stock leads the odd ones, patched the even.")
@click.option("--quiet", "-q", is_flag=True, help="Print only the ratios.")
def bench_cmd(model_path: str, prompt: str | None, max_tokens: int | None, rounds: int, quiet: bool) -> None:
    """Generate with the stock and the patched model in turn and print prompt and generation
    tokens per second and peak memory for each run as it ends, then patched / stock as the
    median of the per-round ratios.

    Each model first makes a warm-up run of 4 tokens (the patched one traces and compiles its
    decoding). By default the runs then generate as many tokens as let the whole measurement
    take about a minute (from 8 to 128), judged from the stock warm-up's pace; a line on stderr
    says how many and about how long the rounds will take, and after the first round how long
    the rest will. On a terminal a progress bar counts the tokens. For steadier figures on a
    GPU, give more: --max-tokens 256 --rounds 6.

    \b
    Examples:
      graphkern bench --model mlx-community/Llama-3.2-1B-Instruct-4bit
      graphkern bench --model ./my-checkpoint --prompt "Write a story" --max-tokens 256 --rounds 6

    Exit status: 0 measured, 1 generation failed, 2 bad input, 130 interrupted (Ctrl-C).
    """
    import mlx.core as mx

    from graphkern.models import patch
    from graphkern.models.generation_bench import WARMUP_TOKENS, measure_generation
    from graphkern.nodes import KernelError

    with progress_steps(not quiet) as step:
        step(f"loading {model_path}")
        ckpt = load_checkpoint(model_path, no_tokenizer_hint=(
            "graphkern bench generates text and needs one: copy the tokenizer files (tokenizer.json, "
            "tokenizer_config.json) of the model these weights come from into the folder"))
        tokens = ckpt.tokens_for(prompt)[0].tolist()
        patched = ckpt.twin()
        try:
            records = patch(patched)
        except KernelError as exc:
            raise BadInput(f"cannot patch {model_path}: {exc}") from None
        if not records:
            raise BadInput(f"no layer of {model_path} matches a patch rule: nothing to compare")
    warmup_tokens = WARMUP_TOKENS if max_tokens is None else min(max_tokens, WARMUP_TOKENS)
    generated = "about a minute's worth of generated tokens" if max_tokens is None \
        else f"{_plural(max_tokens, 'generated token')}"
    if not quiet:
        click.echo(f"model {ckpt.describe()}, prompt {_plural(len(tokens), 'token')}, {generated}, "
                   f"{_plural(rounds, 'round')} after a warm-up run of {warmup_tokens} each, "
                   f"device {mx.default_device().type.name}")
        click.echo(patched_line(records))
    with _report(rounds, quiet) as report:
        if report.bar is None and not quiet:
            click.echo(f"warm-up: a run of {warmup_tokens} tokens each (the patched model traces and "
                       "compiles its decoding) ...", err=True)
        try:
            result = measure_generation(ckpt.model, patched, ckpt.tokenizer, tokens, max_tokens, rounds,
                                        progress=report.describe, on_run=report.run_done,
                                        on_token=report.token, on_plan=report.planned,
                                        warmup_tokens=warmup_tokens, seconds=DEFAULT_SECONDS)
        except Exception as exc:
            click.echo(f"error: generating with {model_path} raised {type(exc).__name__}: {exc}", err=True)
            raise SystemExit(1) from None
    if not quiet:
        same, total = result.same_tokens()
        click.echo(f"generated tokens, first round: {same} of {total} the same in both")
    click.echo(f"patched / stock, median of {_plural(rounds, 'round')} of {result.max_tokens} tokens: "
               f"prompt {result.ratio('prompt_tps'):.2f}x, generation {result.ratio('generation_tps'):.2f}x "
               f"tokens-per-sec, peak memory {result.ratio('peak_memory'):.2f}x")


def register(group: click.Group) -> None:
    """Add ``bench`` to the ``graphkern`` group."""
    if bench_cmd.name not in group.commands:
        group.add_command(bench_cmd)
