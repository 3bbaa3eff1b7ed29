"""A reward for the dataflow tests that varies within a group (so advantages and updates are not zero)."""


def by_length(prompts, responses, answers):
    return [float(len(r) % 3) / 2.0 for r in responses]


def parity(prompts, responses, answers):
    """A second reward for several-function runs: the length's parity, None ("not this function's row") for a
    third of the lengths."""
    return [None if len(r) % 3 == 1 else float(len(r) % 2) for r in responses]


def half_uniform(prompts, responses, answers):
    """Every response to a prompt whose characters sum to an even number scores 1 (a group DAPO's dynamic
    sampling drops); the others score by length, so their groups vary."""
    return [1.0 if sum(map(ord, p)) % 2 == 0 else float(len(r) % 3) / 2.0 for p, r in zip(prompts, responses)]


def fails_on_some_prompts(prompts, responses, answers):
    """by_length, but raises on a prompt whose characters sum to a multiple of 3 (a third of the prompts)."""
    for p in prompts:
        if sum(map(ord, p)) % 3 == 0:
            raise KeyError(f"no reference for {p!r}")
    return by_length(prompts, responses, answers)


def fails_on_some_groups(prompts, responses, answers):
    """by_length, but raises on a prompt whose characters sum to a multiple of 3 when it comes with several
    responses (a training group, not the one greedy answer of an evaluation)."""
    for p in prompts:
        if sum(map(ord, p)) % 3 == 0 and prompts.count(p) > 1:
            raise KeyError(f"no reference for {p!r}")
    return by_length(prompts, responses, answers)


def hangs_on_some_groups(prompts, responses, answers):
    """by_length, but hangs for 2 s on a prompt whose characters sum to a multiple of 3 when it comes with
    several responses (a training group, not the one greedy answer of an evaluation)."""
    import time

    if any(sum(map(ord, p)) % 3 == 0 and prompts.count(p) > 1 for p in prompts):
        time.sleep(2)
    return by_length(prompts, responses, answers)


def logs_length(prompts, completions, log_extra, **kwargs):
    """by_length in TRL's shape, logging each completion's length and text (``log_extra``) for the samples."""
    log_extra("chars", [len(c) for c in completions])
    log_extra("echo", list(completions))
    return by_length(prompts, completions, None)


def solves_even(prompts, responses, answers):
    """Every response to a prompt whose first number is even scores 1 (solved: data.retire_solved retires it);
    the others score by length below 1 (never solved)."""
    return [1.0 if int(p.split("+")[0]) % 2 == 0 else float(len(r) % 3) / 4.0 for p, r in zip(prompts, responses)]


def graded_even(prompts, responses, answers):
    """Partial credit that never reaches 1: 0.6 for every response to a prompt whose first number is even,
    below 0.5 (by length) for the others (solved at data.retire_score=0.5 or none at the default 1.0)."""
    return [0.6 if int(p.split("+")[0]) % 2 == 0 else float(len(r) % 3) / 5.0 for p, r in zip(prompts, responses)]


def always_solved(prompts, responses, answers):
    """Every response scores 1: each prompt is solved the first time it is drawn."""
    return [1.0] * len(responses)


def by_prompt(prompts, responses, answers):
    """A reward of the prompt alone (its characters' sum mod 5, / 4): the same for any response to it, so a run
    that draws a batch's responses again (an off-policy resume) scores them as the first time."""
    return [float(sum(map(ord, p)) % 5) / 4.0 for p in prompts]
