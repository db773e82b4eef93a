"""The demo checkpoint bundled with the repo (made by scripts/train_demo_t5.py) and prompts it answers."""

from pathlib import Path

DEMO_CHECKPOINT = Path(__file__).parent / "demo_t5"
# (prompt, expected greedy answer); never trained on, two per task.
DEMO_PROMPTS = [
    ("reverse: the cat sat on the mat", "mat the on sat cat the"),
    ("spell out: 347", "three hundred forty seven"),
    ("sort: pear apple fig", "apple fig pear"),
    ("reverse: the blue bird sang on the hill", "hill the on sang bird blue the"),
    ("spell out: 912", "nine hundred twelve"),
    ("sort: plum banana mango cherry", "banana cherry mango plum"),
]
