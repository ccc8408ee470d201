"The stage protocol's helpers used from the installed module (not from a notebook that imported extra names)."
from nanochat_dl.pipe.stages import Chain, ListSource, ShuffleBuffer, draw_index, resume_check


def test_resume_check_runs_from_the_module():
    build = lambda: Chain(ShuffleBuffer(ListSource(range(20), epochs=2), window=4, seed=3))
    assert resume_check(build, 25, horizon=5) == 25


def test_shuffle_draws_are_draw_index():
    # the buffer's k-th draw is draw_index(seed, stream, k, len(window)): a pure function of the counter
    b = ShuffleBuffer(ListSource(list(range(30)), epochs=1), window=7, seed=5, stream=9)
    ref, want = list(range(7)), []
    nxt, k = 7, 0
    while ref:
        j = draw_index(5, 9, k, len(ref)); k += 1
        want.append(ref[j]); ref[j] = ref[-1]; ref.pop()
        if nxt < 30: ref.append(nxt); nxt += 1
    assert [d.address[1] for d in b] == want
