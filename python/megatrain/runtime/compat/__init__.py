"""The torch surface made exact for wrapped models: clip_grad_norm_, autograd and functional_call guards."""
