"""Your own tokenizer (issue 22, part 3): a Hugging Face `tokenizers` BPE trained here on the offline sample's text
(Python's own documentation, nothing downloaded) and a tiktoken `Encoding` built from ranks this package trained, each
through `tokenize` + `StreamingLoader`, `PackedLoader` and the nanochat drop-in: ids equal to the tokenizer's own
encode, batches equal to the plain reference loader's, exact resume, and the errors (no BOS, a BOS not in the
vocabulary, a vocabulary the loaders cannot hold, `tokenizers` missing)."""
import itertools, json, subprocess, sys
from pathlib import Path

import numpy as np
import pytest
import tiktoken
import torch

from nanochat_dl.cli import main
from nanochat_dl.dataloader import tokenizing_distributed_data_loader_with_state_bos_bestfit as dropin
from nanochat_dl.text.adapt import MAX_TEXT_IDS, EncodingTokenizer, HFTokenizer, as_tokenizer, load_tokenizer
from nanochat_dl.text.loader import PackedLoader
from nanochat_dl.text.sample import make_sample_shards, sample_documents
from nanochat_dl.text.stages import reference_loader
from nanochat_dl.text.tokenizer import Tokenizer, tokenizer_fingerprint
from nanochat_dl.tokens import TokenFile, TokenRoot, read_manifest, tokenize
from nanochat_dl.tokens.loader import StreamingLoader

tokenizers = pytest.importorskip('tokenizers')   # (in the dev extras)


def train_hf(texts, vocab_size=600, specials=('<s>', '</s>')):
    from tokenizers import Tokenizer as HF, decoders, models, pre_tokenizers, trainers
    t = HF(models.BPE())
    t.pre_tokenizer, t.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    t.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                     show_progress=False))
    return t


class Own:
    "A tokenizer's own encode, for the reference loader: `[bos] + ids` of each text, nothing of this package between."
    def __init__(self, encode_one, bos): self.one, self.bos = encode_one, bos
    def get_bos_token_id(self): return self.bos
    def encode(self, texts, prepend=None, num_threads=1): return [[prepend] + list(self.one(t)) for t in texts]


@pytest.fixture(scope='module')
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp('owntok')
    docs = sample_documents()[:240]
    make_sample_shards(d / 'text', n_shards=3, row_group_size=16, docs=docs)
    hf = train_hf(docs[:120])
    hf.save(str(d / 'tokenizer.json'))
    ours = Tokenizer.train_from_iterator(docs[:120], 600)
    e = ours.enc
    enc = tiktoken.Encoding('mine', pat_str=e._pat_str, mergeable_ranks=e._mergeable_ranks,
                            special_tokens=e._special_tokens)
    own = {'hf': Own(lambda t: hf.encode(t, add_special_tokens=False).ids, 0),
           'tiktoken': Own(enc.encode_ordinary, enc.encode_single_token('<|bos|>'))}
    return dict(dir=d, docs=docs, hf=hf, enc=enc, ours=ours, own=own, files=sorted((d / 'text').glob('*.parquet')))


KINDS = ['hf', 'hf-path', 'tiktoken']


def given(env, kind):
    return {'hf': env['hf'], 'hf-path': str(env['dir'] / 'tokenizer.json'), 'tiktoken': env['enc']}[kind]


def test_ids_are_the_tokenizers_own(env):
    ht, tt = as_tokenizer(env['hf']), as_tokenizer(env['enc'])
    assert isinstance(ht, HFTokenizer) and isinstance(tt, EncodingTokenizer)
    for doc in env['docs'][150:170]:
        assert ht.encode(doc) == env['hf'].encode(doc, add_special_tokens=False).ids
        assert tt.encode(doc) == env['enc'].encode_ordinary(doc) == env['ours'].encode(doc)
        assert ht.decode(ht.encode(doc)) == doc and tt.decode(tt.encode(doc)) == doc
    assert (ht.get_bos_token_id(), ht.get_eos_token_id()) == (0, 1)
    assert tokenizer_fingerprint(tt) == tokenizer_fingerprint(env['ours'])   # the same ranks: the same tokenizer
    assert as_tokenizer(env['ours']) is env['ours']                            # ours: the very object
    assert load_tokenizer(env['dir'] / 'tokenizer.json').fingerprint() == ht.fingerprint()


@pytest.mark.parametrize('kind', KINDS)
@pytest.mark.parametrize('tokenize_in', ['threads', 'processes'])
def test_packed_loader_batches_are_the_references_and_resume_exactly(env, kind, tokenize_in):
    own = env['own']['tiktoken' if kind == 'tiktoken' else 'hf']
    text = env['dir'] / 'text'
    ref = reference_loader(own, 2, 48, 'train', tokenizer_threads=1, tokenizer_batch_size=8, buffer_size=16,
                           data_dir=text)
    want = [(x.clone(), y.clone(), st) for x, y, st in itertools.islice(ref, 12)]   # (its buffers are reused)
    kw = dict(split='train', data_dir=text, tokenizer_threads=2, tokenizer_batch_size=8, pack_buffer=16, device='cpu',
              tokenize_in=tokenize_in)
    with PackedLoader(given(env, kind), 2, 48, **kw) as ld:
        got = [next(ld) for _ in range(12)]
    for (x, y, _), b in zip(want, got):
        assert torch.equal(x, b.inputs) and torch.equal(y, b.targets)
    with PackedLoader(given(env, kind), 2, 48, resume_state_dict=got[4].state, **kw) as ld:   # resumes after batch 4
        for b in got[5:]:
            assert torch.equal(next(ld).inputs, b.inputs)


@pytest.mark.parametrize('kind', ['hf', 'tiktoken'])
def test_the_dropin_takes_them_and_resumes_exactly(env, kind, monkeypatch):
    monkeypatch.setenv('NANOCHAT_DL_DATA_DIR', str(env['dir'] / 'text'))
    own = env['own'][kind]
    ref = reference_loader(own, 2, 32, 'train', tokenizer_threads=1, tokenizer_batch_size=8, buffer_size=16)
    s = dropin(given(env, kind), 2, 32, 'train', tokenizer_threads=1, tokenizer_batch_size=8, device='cpu',
               buffer_size=16)
    got = [(x.clone(), y.clone(), st) for x, y, st in itertools.islice(s, 8)]   # (views of reused buffers)
    s.close()
    for (x, y, _), (gx, gy, _) in zip(itertools.islice(ref, 8), got):
        assert torch.equal(x, gx) and torch.equal(y, gy)
    s = dropin(given(env, kind), 2, 32, 'train', tokenizer_threads=1, tokenizer_batch_size=8, device='cpu',
               buffer_size=16, resume_state_dict=got[3][2])   # a batch's state resumes *at* that batch
    try:
        for x, y, _ in got[3:]:
            gx, gy, _ = next(s)
            assert torch.equal(gx, x) and torch.equal(gy, y)
    finally: s.close()


def test_resuming_with_another_tokenizer_is_refused(env):
    kw = dict(files=env['files'][:-1], tokenizer_threads=1, device='cpu', tokenize_in='threads')
    with PackedLoader(env['hf'], 2, 32, **kw) as ld: st = next(ld).state
    with pytest.raises(ValueError, match='saved with a different tokenizer'):
        PackedLoader(env['enc'], 2, 32, resume_state_dict=st, **kw)
    with pytest.raises(ValueError, match='saved with a different tokenizer'):   # another BOS, another tokenizer
        PackedLoader(as_tokenizer(env['hf'], bos='</s>'), 2, 32, resume_state_dict=st, **kw)


@pytest.mark.parametrize('kind', ['hf', 'hf-path', 'tiktoken'])
def test_tokenize_then_the_streaming_loader(env, kind, tmp_path):
    own = env['own']['tiktoken' if kind == 'tiktoken' else 'hf']
    root = tmp_path / 'root'
    if kind == 'hf-path':   # the command, with --tokenizer
        assert main(['tokenize', '--data-dir', str(env['dir'] / 'text'), '--out', str(root), '--dataset', 'web',
                     '--tokenizer', given(env, kind), '-w', '2', '--no-progress']) == 0
    else: tokenize(env['dir'] / 'text', root, 'web', tokenizer=given(env, kind), workers=2, progress=False, verbose=False)
    import pyarrow.parquet as pq
    for f in env['files'][:-1]:
        texts = pq.read_table(f).column('text').to_pylist()
        with TokenFile(root / 'web' / (f.stem + '.arrow')) as tf:
            assert [tf.doc(i).tolist() for i in range(len(tf))] == [own.one(t) for t in texts if own.one(t)]
    rec = read_manifest(root)['datasets']['web']['tokenizer']
    assert rec['fingerprint'] == as_tokenizer(given(env, kind)).fingerprint()
    TokenRoot(root, tokenizer=given(env, kind), verify='off').close()   # the same tokenizer: accepted
    other = env['enc'] if kind != 'tiktoken' else env['hf']
    with pytest.raises(ValueError, match='tokenized with another tokenizer'):
        TokenRoot(root, tokenizer=other, verify='off')
    with pytest.raises(ValueError, match='tokenized with another tokenizer'):   # and not mixed into one root
        tokenize(env['dir'] / 'text', root, 'more', tokenizer=other, workers=1, progress=False, verbose=False)
    bos = as_tokenizer(given(env, kind)).get_bos_token_id()
    kw = dict(bos_token=bos, shuffle_window=0, prefetch=0)
    with StreamingLoader(root, 4, 32, **kw) as ld:
        got = [next(ld) for _ in range(3)]
        sd = ld.state_dict()
        got += [next(ld) for _ in range(3)]
    flat = set(itertools.chain.from_iterable(own.one(t) for t in env['docs']))
    assert all(set(b.inputs.flatten().tolist()) <= flat | {bos} for b in got)   # the tokenizer's ids, and its BOS
    with StreamingLoader(root, 4, 32, **kw) as ld:   # resumed: the same batches
        ld.load_state_dict(sd)
        assert all(torch.equal(next(ld).inputs, b.inputs) for b in got[3:])


def test_errors_name_the_tokenizer_the_value_and_what_was_expected(env, tmp_path):
    with pytest.raises(ValueError, match=r"bos='<\|bos\|>' is not a token of HFTokenizer\('BPE tokenizer'"):
        as_tokenizer(env['hf'], bos='<|bos|>')
    with pytest.raises(ValueError, match=r"bos=700 is not an id of EncodingTokenizer\('mine', vocab_size=600.*"
                                         r"expected an id in its vocabulary \[0, 600\)"):
        as_tokenizer(env['enc'], bos=700)
    nob = train_hf(env['docs'][:60], specials=('<pad>',))
    assert as_tokenizer(nob).fingerprint()['bos_id'] is None   # fine for token files (they hold no BOS) ...
    with pytest.raises(ValueError, match=r"has no BOS token: none of its special tokens \['<pad>'\] is one of"):
        PackedLoader(nob, 2, 32, files=env['files'][:1], device='cpu')   # ... not for the text loader
    ld = PackedLoader(as_tokenizer(nob, bos='<pad>'), 2, 32, files=env['files'][:1], device='cpu')   # given: fine
    ld.close()
    e = env['enc']   # a special token at id 2**31: tiktoken takes it, the text loader's int32 arrays cannot
    big = tiktoken.Encoding('big', pat_str=e._pat_str, mergeable_ranks=e._mergeable_ranks,
                            special_tokens={'<|bos|>': MAX_TEXT_IDS})
    with pytest.raises(ValueError, match=r"EncodingTokenizer\('big', vocab_size=2147483649.*has a vocabulary of "
                                         r"2,147,483,649 ids, more than 2,147,483,648: the text loaders' encoders"):
        PackedLoader(big, 2, 32, files=env['files'][:1], device='cpu')

    class Huge(Own):   # says it has more ids than a uint32 token file holds
        def get_vocab_size(self): return 2**32 + 1
        def __repr__(self): return 'Huge()'
    with pytest.raises(ValueError, match=r"Huge\(\) has a vocabulary of 4,294,967,297 ids, more than 4,294,967,296: "
                                         "token files hold uint32 ids"):
        tokenize(env['dir'] / 'text', tmp_path / 'r', 'web', tokenizer=Huge(len, 0), progress=False, verbose=False)
    class Duck(Own):   # a tokenizer the loaders take (its own encode, in threads), but no core for tokenize's workers
        def get_vocab_size(self): return 600
        def __repr__(self): return 'Duck()'
    with pytest.raises(ValueError, match=r"Duck\(\) has no tiktoken or Hugging Face core for worker processes"):
        tokenize(env['dir'] / 'text', tmp_path / 'r', 'web', tokenizer=Duck(len, 0), progress=False, verbose=False)
    with pytest.raises(TypeError, match="tokenizer=3 is not a tokenizer"): as_tokenizer(3)
    with pytest.raises(ValueError, match="pass tokenizer or tokenizer_dir, not both"):
        tokenize(env['dir'] / 'text', tmp_path / 'r', 'web', env['dir'], tokenizer=env['hf'])


def test_without_the_tokenizers_package(env, tmp_path):
    "The package imports and runs without `tokenizers`; a tokenizer.json then gets a clear error."
    code = ("import sys; sys.modules['tokenizers'] = None\n"
            "import nanochat_dl, nanochat_dl.text.adapt as a, nanochat_dl.text.loader, nanochat_dl.tokens\n"
            f"try: a.load_tokenizer({str(env['dir'] / 'tokenizer.json')!r})\n"
            "except ImportError as e: print(e)\n")
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True).stdout
    assert "tokenizer.json needs the Hugging Face `tokenizers` package, which is not installed: pip install tokenizers" in out


def test_check_resume_and_inspect_take_a_tokenizer_json(env, tmp_path, capsys):
    tj = str(env['dir'] / 'tokenizer.json')
    assert main(['check-resume', '--data', str(env['dir'] / 'text'), '--tokenizer-dir', tj, '--batches', '6',
                 '--stop', '3', '-b', '2', '-t', '32']) == 0
    assert 'PASS' in capsys.readouterr().out


def test_inspect_decodes_with_a_tokenizer_json(env, tmp_path, capsys):
    "`inspect --tokenizer-dir tokenizer.json --decode` replays a run of that tokenizer and shows its text; another is refused."
    from nanochat_dl.tokens.elastic import save_loader_states
    tj = env['dir'] / 'tokenizer.json'
    with PackedLoader(str(tj), 2, 64, data_dir=env['dir'] / 'text', tokenizer_threads=1, device='cpu') as ld:
        for step in range(6):
            b = next(ld)
            if step == 3: save_loader_states(tmp_path / 'ckpt', b.state, step, rank=0, world_size=1)
    texts = [as_tokenizer(env['hf']).decode(row[1:].tolist())[:20] for row in b.inputs if row[0] == 0]
    capsys.readouterr()
    assert main(['inspect', str(tmp_path / 'ckpt'), '--steps', '5', '--data', str(env['dir'] / 'text'),
                 '--tokenizer-dir', str(tj), '--decode']) == 0
    out = capsys.readouterr().out
    assert 'step 5' in out and any(t.strip()[:10] in out for t in texts), out[-2000:]
    env['ours'].save(tmp_path / 'ours')
    assert main(['inspect', str(tmp_path / 'ckpt'), '--steps', '5', '--data', str(env['dir'] / 'text'),
                 '--tokenizer-dir', str(tmp_path / 'ours')]) == 2
    assert 'different tokenizer' in capsys.readouterr().err
