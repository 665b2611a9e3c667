"""The functional API (horovod_terngrad.allreduce / allreduce_async): its compressors per config."""

def test_the_functional_apis_compressors_are_bounded_least_recently_used_first(caplog):
    import horovod_terngrad as tg
    tg._compressors.clear()
    tg._said_dropped = False
    try:
        assert tg._compressor_for(None) is tg.TernGrad and tg._compressor_for(tg.TernGrad.config) is tg.TernGrad
        configs = [tg.TernGradConfig(seed=s) for s in range(1, tg.MAX_FUNCTIONAL_CONFIGS + 1)]
        first = [tg._compressor_for(c) for c in configs]
        assert tg._compressor_for(configs[0]) is first[0]          # kept, and now the most recently used
        with caplog.at_level("WARNING", logger="horovod_terngrad"):
            extra = tg._compressor_for(tg.TernGradConfig(seed=999))
            tg._compressor_for(tg.TernGradConfig(seed=1000))
        assert len(tg._compressors) == tg.MAX_FUNCTIONAL_CONFIGS
        assert configs[0] in tg._compressors and configs[1] not in tg._compressors and configs[2] not in tg._compressors
        assert tg._compressor_for(tg.TernGradConfig(seed=999)) is extra
        assert sum("distinct configs" in r.message for r in caplog.records) == 1       # said once
    finally:
        tg._compressors.clear()
        tg._said_dropped = False
