"""`physreason experiment`: the learning experiments that check training learns on this machine (docs/experiments.md).

Each subcommand hands its arguments, `--help` included, to the experiment's own parser
(physreason/experiments/<name>.py): the options, their defaults and their help are the experiment's, in one place.
"""

from __future__ import annotations

import typer

app = typer.Typer(
    help="Learning experiments: train a small model from scratch on synthetic clips (SFT, then GRPO) and print the "
    "held-out table, to check that training learns on this machine. Resumable: rerun with the same --out.",
    no_args_is_help=True,
)

# Every argument, --help too, goes to the experiment's parser: typer declares none of its own.
PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


@app.command("intuitive-physics", context_settings=PASS_THROUGH, add_help_option=False)
def intuitive_physics(ctx: typer.Context) -> None:
    """Letter tasks (arrow of time, spatial puzzle, object permanence): accuracy of the untrained model, after SFT and
    after SFT+GRPO, as in the Cosmos-Reason1 paper's intuitive-physics table. --help lists the options."""
    from physreason.experiments.intuitive_physics import main

    main(list(ctx.args), prog="physreason experiment intuitive-physics")


@app.command("grounding", context_settings=PASS_THROUGH, add_help_option=False)
def grounding(ctx: typer.Context) -> None:
    """Grounding and temporal localization (JSON answers): IoU after SFT, then GRPO with the IoU reward against its
    SFT control, clip by clip. --help lists the options."""
    from physreason.experiments.grounding import main

    main(list(ctx.args), prog="physreason experiment grounding")
