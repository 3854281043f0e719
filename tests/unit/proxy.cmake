# Unit tests of the proxy's pure modules.
foreach(m json rewrite http config)
  px_unit_test(${m} pxcore)
endforeach()
