"""Loading packed checkpoints and generating text with them."""
