"""kdexp.distributed"""
