"""Multi-turn environments and tools (NeMo RL's environments).

* :mod:`.base` - the ``Environment`` protocol (``reset``, ``step``) and the records (``StepResult``, ``Episode``);
* :mod:`.episodes` - many episodes at once, continuously batched across turns on the native engine;
* :mod:`.tools` - the tool-call format, the calculator and the Python tool, the built-in tool environment (what
  tools and environments write is tokenized as plain text: :mod:`relayrl.data.plain_text`);
* :mod:`.sandbox` - the jail the Python tool runs model-written code in (built by the script
  ``sandbox_boot.py``; its system-call filter in :mod:`.sandbox_seccomp`, its cgroup in :mod:`.sandbox_cgroup`);
* :mod:`.config` - the ``env`` config section, loading environments and tools by dotted path;
* :mod:`.task` - ``toolsum``, a built-in task the tiny model solves only with its calculator.
"""
