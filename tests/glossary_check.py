"""Every scalar a real run logged is in the metric glossary (moe_rl/glossary.py, docs/metrics.md): called,
one line each, by the tests that already run training and read its TensorBoard files."""

from pathlib import Path

from moe_rl import glossary


def logged_tags(tensorboard_dir: str | Path) -> set[str]:
    """The scalar tags of a run's TensorBoard event files (a run's tensorboard/NAME folder)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tensorboard_dir), size_guidance={"scalars": 1, "images": 0, "histograms": 0})
    acc.Reload()
    return set(acc.Tags()["scalars"])


def assert_tags_in_glossary(tensorboard_dir: str | Path) -> set[str]:
    """Fails naming each tag the run logged that the glossary does not describe; the tags otherwise."""
    tags = logged_tags(tensorboard_dir)
    assert tags, f"no scalars logged under {tensorboard_dir}"
    missing = glossary.undescribed(tags)
    assert not missing, (f"logged but not in the metric glossary: {missing}; describe them in "
                         "moe_rl/glossary.py, then `moe-rl metrics docs > docs/metrics.md`")
    return tags
