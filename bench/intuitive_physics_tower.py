"""The vision tower's pre-training on its own, as the intuitive-physics experiment runs it: its module,
physreason/experiments/tower.py, says what it does; `--help` lists the arguments. Same arguments here."""

from physreason.experiments.tower import main

if __name__ == "__main__":
    main()
