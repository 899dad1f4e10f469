"""The report side: tables, figures and logs of a run's or a sweep's results.

    run_summary   a run's table.md and its terminal summary
    tables        the papers' table shapes over the records of many runs
    plots         the figures (learning curves, GradAlign weights, t-SNE, ...)
    metrics_log   metrics.jsonl and TensorBoard events, written at every evaluation

Everything here reads results (dicts of results.json) and writes files; nothing
here reads a config or runs anything.
"""
