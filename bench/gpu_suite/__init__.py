"""bench/gpu.py's stages, one module each: the sizes they run at (sizes), the device's
measured peaks (device), attention backends (backends), the train step (train_step),
decoding (decoding), and the tables they print (report)."""
