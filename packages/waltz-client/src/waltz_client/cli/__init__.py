"""The client's commands of the ``waltz`` command line: ``waltz client`` (append, tail,
high-water-mark) and ``waltz perf`` (load a cluster and measure it), contributed
through the ``waltz_cli_commands`` hook (:mod:`waltz_client.plugin`); they need the
``cli`` extra (``pip install 'waltz-client[cli]'``, part of ``[default]``)."""
