# Unit tests of the proxy's pure modules.
foreach(m json rewrite http config log)
  px_unit_test(${m} pxcore)
endforeach()
