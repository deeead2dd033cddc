"""The wrapped model: decoder layers found and streamed, the nn.Module surface."""
