"""A reward for the dataflow tests that varies within a group (so advantages and updates are not zero)."""


def by_length(prompts, responses, answers):
    return [float(len(r) % 3) / 2.0 for r in responses]
