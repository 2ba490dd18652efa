"""What the decoding features compute on the host: each feature's plug-in (runtime/features/) calls the
module here that holds its logic (DRY, banned strings, grammars, CFG, speculation, logit lens, prompt
logprobs, a vision family's images)."""
