"""``tessera bench``: scheduler benchmarks on kwok dev clusters, Tessera against the stock
kube-scheduler.

Pure parts: ``workload`` (the pod mix and its two renderings), ``stats`` (percentiles,
rates), ``promtext`` (Prometheus text, histogram quantiles), ``procstat`` (/proc CPU and RSS)
and ``report`` (JSON, Markdown, plots). Adapters: ``cluster`` (the tuned dev cluster and the
two schedulers), ``watcher`` (bind times from a pod watch), ``batches`` (create, wait,
summarize), ``sampling`` (measurements at marks), ``scenarios``, ``runner`` (phases) and
``cli``; ``pyprofile`` profiles the Python processes on request.
"""
