"""``graphkern bench --model PATH``: stock against patched generation of a checkpoint, measured
with mlx-lm's own loop and printed as ``mlx_lm.generate --verbose`` prints its figures."""

from __future__ import annotations

import click

from graphkern.cli.commands import progress_steps
from graphkern.cli.errors import BadInput
from graphkern.cli.model import DEFAULT_PROMPT, load_checkpoint, patched_line

__all__ = ["bench_cmd", "register"]


@click.command("bench")
@click.option("--model", "model_path", metavar="PATH", required=True,
              help="An mlx-lm checkpoint folder (or a Hugging Face Hub id), loaded with mlx_lm.load.")
@click.option("--prompt", metavar="TEXT", default=None,
              help=f"The prompt, through the model's chat template (default {DEFAULT_PROMPT!r}).")
@click.option("--max-tokens", "-m", default=100, show_default=True, type=click.IntRange(min=1),
              help="Tokens to generate each run (the end of sequence is ignored).")
@click.option("--rounds", "-n", default=3, show_default=True, type=click.IntRange(min=1),
              help="Rounds; each runs stock then patched, after one warm-up run each.")
@click.option("--quiet", "-q", is_flag=True, help="Print only the ratios.")
def bench_cmd(model_path: str, prompt: str | None, max_tokens: int, rounds: int, quiet: bool) -> None:
    """Generate with the stock and the patched model in turn and print prompt and generation
    tokens per second and peak memory for each run, then patched / stock as the median of the
    per-round ratios.

    \b
    Examples:
      graphkern bench --model mlx-community/Llama-3.2-1B-Instruct-4bit
      graphkern bench --model ./my-checkpoint --prompt "Write a story" --max-tokens 256 --rounds 5

    Exit status: 0 measured, 1 generation failed, 2 bad input.
    """
    import mlx.core as mx

    from graphkern.models import patch
    from graphkern.models.generation_bench import measure_generation
    from graphkern.nodes import KernelError

    with progress_steps(not quiet) as step:
        step(f"loading {model_path}")
        ckpt = load_checkpoint(model_path)
        tokens = ckpt.tokens_for(prompt)[0].tolist()
        patched = ckpt.twin()
        try:
            records = patch(patched)
        except KernelError as exc:
            raise BadInput(f"cannot patch {model_path}: {exc}") from None
        if not records:
            raise BadInput(f"no layer of {model_path} matches a patch rule: nothing to compare")
        if not quiet:
            click.echo(f"model {ckpt.describe()}, prompt {len(tokens)} tokens, {max_tokens} generated "
                       f"tokens, {rounds} round{'s' if rounds != 1 else ''} after a warm-up run each, "
                       f"device {mx.default_device().type.name}")
            click.echo(patched_line(records))
        try:
            result = measure_generation(ckpt.model, patched, ckpt.tokenizer, tokens, max_tokens,
                                        rounds, progress=step)
        except Exception as exc:
            click.echo(f"error: generating with {model_path} raised {type(exc).__name__}: {exc}", err=True)
            raise SystemExit(1) from None
    if not quiet:
        for index, runs in enumerate(result.rounds, 1):
            for side, run in runs.items():
                click.echo(f"round {index}  {side:<7}  {run.verbose_line()}")
        same, total = result.same_tokens()
        click.echo(f"generated tokens, first round: {same} of {total} the same in both")
    click.echo(f"patched / stock, median of {rounds} round{'s' if rounds != 1 else ''}: "
               f"prompt {result.ratio('prompt_tps'):.2f}x, generation {result.ratio('generation_tps'):.2f}x "
               f"tokens-per-sec, peak memory {result.ratio('peak_memory'):.2f}x")


def register(group: click.Group) -> None:
    """Add ``bench`` to the ``graphkern`` group."""
    if bench_cmd.name not in group.commands:
        group.add_command(bench_cmd)
