"""The offline sample (`nanochat_dl.text.sample`) against the tokenizer of a later chapter, which its chapter may not import."""
from nanochat_dl.text.sample import CHARS_PER_TOKEN, sample_shard_documents
from nanochat_dl.text.tokenizer import Tokenizer


def test_chars_per_token_is_what_an_8k_tokenizer_gives_on_the_sample():
    "`CHARS_PER_TOKEN`: an 8,192-id tokenizer trained on the train shards' documents gives this many characters per token on them (from the sample chapter, `nbs/text/02b_sample.ipynb`)."
    shard_docs = sample_shard_documents()
    train_text = [t for s in shard_docs[:-1] for t in s]
    tok8k = Tokenizer.train_from_iterator(train_text, 8192)
    cpt = sum(map(len, train_text)) / sum(map(len, tok8k.encode(train_text, num_threads=2)))
    assert abs(cpt - CHARS_PER_TOKEN) <= 0.1, cpt
