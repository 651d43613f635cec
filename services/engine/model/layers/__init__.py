"""The building blocks of a decoder: RoPE, attention (GQA with its variants as parameters, and
latent attention), the dense SwiGLU MLP, the MoE block and the decoder layer that holds them.
Families (model/families/) assemble them; a backend (kernels/backend.py) runs their products."""
