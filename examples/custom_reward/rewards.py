"""A reward function of your own: `environment.name: single_turn` + `environment.reward_fn`.

Called once per episode with the dataset row and the model's decoded answer; returns a float, or a
dict with a `reward` and other numbers to log (their mean per step appears as env/NAME).
"""

import re


def exact_number(row: dict, response: str) -> dict:
    """1 for an answer whose first number is the row's `answer`, 0.1 for some other number, 0 for none."""
    m = re.search(r"-?\d+", response)
    if m is None:
        return {"reward": 0.0, "has_number": 0.0}
    return {"reward": 1.0 if int(m.group()) == int(row["answer"]) else 0.1, "has_number": 1.0}
