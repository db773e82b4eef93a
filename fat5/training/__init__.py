"""Training code that checkpoints do not need (packing, denoising objectives, the pretraining entry point).

Nothing in `fat5/training/` is exported into model folders; it imports the model package, never the reverse."""
