"""The planners Mimose is measured against (docs/BASELINES.md): ``none`` and ``full``
(``uniform``), ``sublinear``, ``hf-every-n`` (``every_n``), ``dtr``, ``oracle`` and ``offload``
(``full_offload``). A baseline may use Mimose's estimator and probes; Mimose uses no baseline."""
