"""What runs on the device: the compiled step (forward + gather + sampler) as pure programs, its packed
host inputs, the sampler (truncation, mirostat), the vision encoders' programs, and how weights are fitted."""
